"""Import-only stand-ins for packages SGLang 0.5.23 imports at module level but that fp8ptq's SGLang checks
never call, put on the path of the SGLang subprocess only (engine/sglang_engine.py), never of fp8ptq:

- torchvision: its multimodal helpers (`sglang.srt.configs` -> `internvl_utils`: `import
  torchvision.transforms as T`) sit on every path to its compressed-tensors config classes and model
  classes; the package index has CUDA builds only, whose operators do not register against .venv-vllm's
  CPU torch;
- sgl_kernel: its CUDA/CPU kernel package (not on the index for this torch); the CPU engine imports names
  from it at start-up (`mem_cache/memory_pool.py`) and, with `SGLANG_USE_CPU_ENGINE=1` and the
  `torch_native` attention backend, a bf16/fp32 model generates without calling any of them.

Every name of a stand-in is an object that raises when called, naming itself, so a path that does need
the real package fails loudly instead of computing anything.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class Absent:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: an import-only stand-in in fp8ptq's SGLang checks (engine/standins)")

    def __mro_entries__(self, bases):  # `class X(package.something)` at import time
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{self.__name__}.{attr}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import <package>.<anything>` gives a module of Absent names."""

    def __init__(self, package: str):
        self.prefix = package + "."

    def find_spec(self, name, path=None, target=None):
        if name.startswith(self.prefix):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def install(package: str, namespace: dict) -> None:
    """Make the package whose __init__ calls this (with its globals()) a stand-in: its attributes and every
    submodule's are Absent names."""

    def absent(attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Absent(f"{package}.{attr}")

    namespace["__getattr__"] = absent
    namespace["__version__"] = "0.0.0+standin"
    sys.meta_path.insert(0, _Submodules(package))
