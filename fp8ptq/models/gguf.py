"""A GGUF file read lazily, tensor by tensor, with Hugging Face names and row order.

Config, tokenizer and the GGUF -> HF tensor-name map come from transformers' own GGUF loader
(`transformers.modeling_gguf_pytorch_utils`, 5.24): `AutoConfig(gguf_file=...)`, `get_gguf_hf_weights_map`
over a meta-device model, and its per-architecture `TensorProcessor`. Which architectures are read is
transformers' list (`GGUF_SUPPORTED_ARCHITECTURES`); the model type it parses (llama.cpp's `gemma3` is
transformers' `gemma3_text`) picks fp8ptq's adapter or the generic path, as for a safetensors folder.

Integer codes are carried only where the processor leaves a quantized tensor's values alone: it moves rows
(Llama's q/k un-permutation: a Q4_0/Q8_0 block lies within one row) or touches only tensors llama.cpp
stores as floats (Gemma's and Nemotron's `norm.weight - 1`). Any other processor's tensors are dequantized
by gguf-py and processed as transformers processes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fp8ptq.errors import ModelError
from fp8ptq.models.arch import Arch, arch_for
from fp8ptq.ops.ggml import unpack_q4_0, unpack_q5_0, unpack_q8_0
from fp8ptq.ops.kquant import K_TYPES  # carried onto the INT8 group-32 grid, re-rounded (ops/kquant.int8_grid)

EXACT_TYPES = {"Q4_0": 4, "Q8_0": 8, "Q5_0": 8}  # GGML type -> bits of the symmetric group-32 INT grid it is
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# transformers' processors -> the tensors (by a substring of the GGUF name) whose values they change; the
# rest they return as they are, or (Llama) with rows reordered, which is safe on codes and scales.
CODE_SAFE_PROCESSORS = {
    "TensorProcessor": (),
    "LlamaTensorProcessor": (),
    "T5TensorProcessor": (),
    "Gemma2TensorProcessor": ("norm.weight",),
    "NemotronTensorProcessor": ("norm.weight",),
}


def open_reader(path: Path):
    """gguf.GGUFReader of `path` (its metadata within gguf_limits' bounds first), or a one-line ModelError."""
    from fp8ptq.models.gguf_limits import check_metadata

    try:
        check_metadata(path)
    except PermissionError:
        raise ModelError(f"cannot read '{path}' (permission denied)", fix="make it readable by this user") from None
    try:
        from gguf import GGUFReader

        return GGUFReader(str(path))
    except PermissionError:
        raise ModelError(f"cannot read '{path}' (permission denied)", fix="make it readable by this user") from None
    except ValueError as err:  # the header promises more tensor data than the file holds
        raise ModelError(
            f"'{path}' is truncated or corrupt (its tensor data do not fit the file: {err})", fix="re-download it"
        ) from None
    except Exception as err:  # gguf raises assorted errors on a file that is not GGUF at all
        raise ModelError(
            f"'{path}' is not a readable GGUF file ({type(err).__name__}: {err})",
            fix="pass a .gguf file written by llama.cpp's converter",
        ) from None


def gguf_architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ModelError(
            "the GGUF file has no general.architecture: not a model GGUF",
            fix="pass a .gguf file written by llama.cpp's converter",
        )
    return str(bytes(field.parts[-1]), "utf-8")


@dataclass
class GgufTensor:
    """One tensor of the file: its GGUF and HF names, GGML type and HF shape ([out, in] for matrices)."""

    gguf_name: str
    name: str
    ggml_type: str
    shape: tuple[int, ...]
    _raw: object  # the reader's memory-mapped array


@dataclass(eq=False)
class GgufModel:
    path: Path
    reader: object
    config: object  # transformers PretrainedConfig
    arch: Arch
    tensors: list[GgufTensor]  # in file order; tensors transformers would not load are left out
    dropped: list[str]  # GGUF tensors with no HF name (e.g. llama.cpp's precomputed rope_freqs)
    processor: object  # transformers' TensorProcessor of the architecture
    skeleton: torch.nn.Module  # the model on the meta device (module types and fused groups)

    def _rows(self, t: GgufTensor, arr: np.ndarray) -> np.ndarray:
        return self.processor.process(weights=arr, name=t.gguf_name).weights

    def carries_codes(self, t: GgufTensor) -> bool:
        """Whether transformers' processor leaves this tensor's values as stored (rows aside), so that its
        integer codes and block scales are the model's: the condition for carrying them exactly."""
        changed = CODE_SAFE_PROCESSORS.get(type(self.processor).__name__)
        return changed is not None and not any(p in t.gguf_name for p in changed)

    def codes(self, t: GgufTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Q4_0 / Q5_0 / Q8_0 tensor -> (codes int8 [out, in], scale fp32 [out, in/32]) in HF row order; a
        K-quant tensor -> the same on the INT8 grid, re-rounded (ops/kquant.int8_grid)."""
        raw = torch.from_numpy(np.array(t._raw).reshape(t.shape[0], -1))  # a copy: the map is read-only
        if t.ggml_type in K_TYPES:
            from fp8ptq.ops.kquant import int8_grid

            codes, scale = int8_grid(t.ggml_type, raw)
        else:
            codes, scale = {"Q4_0": unpack_q4_0, "Q5_0": unpack_q5_0, "Q8_0": unpack_q8_0}[t.ggml_type](raw)
        codes = torch.from_numpy(np.ascontiguousarray(self._rows(t, codes.numpy())))
        scale = torch.from_numpy(np.ascontiguousarray(self._rows(t, scale.numpy())))
        return codes, scale

    def dequantized(self, t: GgufTensor) -> torch.Tensor:
        """Any tensor as fp32 in HF row order, by gguf's own dequantizer (what transformers loads)."""
        from gguf import GGMLQuantizationType, dequantize

        w = dequantize(np.asarray(t._raw), GGMLQuantizationType[t.ggml_type]).reshape(t.shape)
        return torch.from_numpy(np.ascontiguousarray(self._rows(t, w.astype(np.float32))))

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name, trust_remote_code=False)


def _read(path: Path):
    """(reader, architecture, transformers' parsed config, config, processor class, meta skeleton,
    GGUF -> HF name map) of a GGUF file, reading no tensor data."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    reader = open_reader(path)
    name = gguf_architecture(reader)
    check_supported(name)
    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except ValueError as err:  # transformers' own refusal (e.g. a llama variant it does not map)
        raise ModelError(f"transformers cannot read GGUF '{path}': {err}", fix=_SUPPORTED_FIX) from None
    config = AutoConfig.for_model(**parsed)  # what AutoConfig.from_pretrained(gguf_file=...) builds
    processor_cls = TENSOR_PROCESSORS.get(name, TensorProcessor)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    name_map = get_gguf_hf_weights_map(skeleton, processor_cls(config=parsed))
    return reader, name, parsed, config, processor_cls, skeleton, name_map


def _tensors(reader, name_map) -> tuple[list[GgufTensor], list[str]]:
    tensors, dropped = [], []
    for t in reader.tensors:
        if t.name not in name_map:
            dropped.append(t.name)
            continue
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 (the row length) first
        tensors.append(GgufTensor(t.name, name_map[t.name], t.tensor_type.name, shape, t.data))
    return tensors, dropped


def open_gguf(path: Path) -> GgufModel:
    """Read the metadata of a GGUF file (no tensor data) into a GgufModel."""
    reader, name, parsed, config, processor_cls, skeleton, name_map = _read(path)
    if processor_cls.__name__ not in CODE_SAFE_PROCESSORS:
        # MoE processors split and merge expert tensors across names: no per-tensor reading of them
        raise ModelError(
            f"GGUF architecture '{name}' is read by transformers' {processor_cls.__name__}, which regroups "
            "tensors; fp8ptq reads such a file only whole",
            fix=f"`fp8ptq convert {path} --to hf -o DIR`, or `fp8ptq quantize {path}` (both read it whole)",
        )
    tensors, dropped = _tensors(reader, name_map)
    check_complete(path, skeleton, tensors)
    return GgufModel(path, reader, config, arch_for(config), tensors, dropped, processor_cls(config=parsed), skeleton)


_SUPPORTED_FIX = (
    "pass the model's safetensors folder instead (or a GGUF of an architecture transformers' GGUF loader reads)"
)


def supported_architectures() -> list[str]:
    """llama.cpp architecture names transformers' GGUF loader reads (its own list, less its non-model keys)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def check_supported(name: str) -> None:
    """ModelError unless transformers reads GGUF architecture `name` (llama.cpp's spelling: qwen2moe and
    gpt-oss are read under transformers' names)."""
    aliases = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
    known = supported_architectures()
    if name not in known and aliases.get(name) not in known:
        raise ModelError(
            f"GGUF architecture '{name}' is not one transformers' GGUF loader reads (it reads: {', '.join(known)})",
            fix=_SUPPORTED_FIX,
        )


def check_gguf(path: Path) -> None:
    """open_gguf's checks (an architecture transformers reads, every tensor its metadata builds present and
    in shape) for a GGUF that transformers dequantizes as a whole."""
    reader, _, _, _, processor_cls, skeleton, name_map = _read(path)
    shapes = processor_cls.__name__ in CODE_SAFE_PROCESSORS  # others reshape or merge tensors as they load
    check_complete(path, skeleton, _tensors(reader, name_map)[0], shapes=shapes)


def check_complete(path: Path, skeleton: torch.nn.Module, tensors: list[GgufTensor], shapes: bool = True) -> None:
    """ModelError unless the file holds what its own metadata builds: a tensor in every one of the blocks
    it declares and none beyond, the embedding, the final norm and an untied head, and every tensor that
    maps onto a module in that module's shape (`shapes`: the file stores tensors as the model holds them).
    transformers would initialise a missing block at random.
    (Per-block tensor sets are not compared: some architectures vary them, e.g. dense-then-MoE.)"""
    from fp8ptq.models.tensors import stored_names

    blocks = getattr(skeleton.config, "num_hidden_layers", None)
    held = {int(t.gguf_name.split(".")[1]) for t in tensors if re.match(r"blk\.\d+\.", t.gguf_name)}
    missing = sorted(set(range(blocks or 0)) - held)
    extra = sorted(held - set(range(blocks or 0)))
    if missing or extra:
        which = f"holds no tensor of block {missing[0]}" if missing else f"holds tensors of block {extra[0]}"
        raise ModelError(
            f"'{path}' declares {blocks} blocks but {which} ({len(held)} blocks present)",
            fix="use a complete GGUF: its metadata and its tensors must describe the same model",
        )
    have = {t.name: t.shape for t in tensors}
    params = {n: tuple(t.shape) for n, t in skeleton.named_parameters()}
    tied = getattr(skeleton.config, "tie_word_embeddings", False)
    for name in stored_names(skeleton):
        if name in have:
            if shapes and name in params and tuple(have[name]) != params[name]:
                raise ModelError(
                    f"'{path}': tensor '{name}' is {list(have[name])} but its metadata builds {list(params[name])}",
                    fix="use a GGUF whose metadata matches its tensors",
                )
        elif ".layers." not in name and not (name == "lm_head.weight" and tied):
            raise ModelError(
                f"'{path}' lacks tensor '{name}', which its metadata builds",
                fix="use a complete GGUF: its metadata and its tensors must describe the same model",
            )
