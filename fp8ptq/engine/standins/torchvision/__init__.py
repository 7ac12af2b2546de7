"""An import-only stand-in for torchvision, put on the path of the SGLang subprocess only
(engine/sglang_engine.py), never of fp8ptq itself.

SGLang 0.5.23 imports torchvision at module level in its multimodal helpers (`sglang.srt.configs` pulls
`internvl_utils`, which does `import torchvision.transforms as T`), and every path to its compressed-tensors
config classes passes through there. The package index has only CUDA builds of torchvision, whose
operators do not register against the CPU torch of .venv-vllm. No code fp8ptq runs through SGLang (its
argument parser, its compressed-tensors scheme resolution, its EAGLE-3 capture rule) calls torchvision:
every name here is an object that raises when it is called, naming itself, so a path that does need
torchvision fails loudly instead of computing anything.
"""

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+standin"


class _Absent:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is an import-only stand-in in fp8ptq's SGLang checks")

    def __mro_entries__(self, bases):  # `class X(torchvision.something)` at import time
        return (object,)


def __getattr__(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return _Absent(f"torchvision.{attr}")


class _Module(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}")


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import torchvision.<anything>` gives a module of _Absent names."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Submodules())
