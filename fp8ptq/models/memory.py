"""A transformers model held in memory as a ModelSource: `fp8ptq.quantize(model, ...)` on a model the user
already has (fine-tuned in a notebook, merged from LoRA) without writing its weights anywhere.

The weights are read from the module's own parameters, one tensor at a time as a copy on the CPU (what a
shard read gives; the run may change what it reads, the user's model must not change). The folder the
run reads its small files from (config.json, the generation config, the tokenizer) is written from the
model's config and the tokenizer into a temporary folder, so the rest of the run, the export's config and
tokenizer included, is the one a model folder gets: a model saved with `save_pretrained` and quantized
from disk gives the same tensors, config and recipe.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8ptq.errors import ModelError, OptionError
from fp8ptq.models.config_checks import check_architectures, check_sizes
from fp8ptq.models.loader import ModelSource

MEMORY = "<memory>"  # the weight map's "shard" for every tensor


@dataclass(eq=False)
class MemorySource(ModelSource):
    tensors: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name].detach().to("cpu", copy=True)

    def tensor_dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def close(self) -> None:  # nothing mapped
        pass

    @property
    def shard_files(self) -> list[str]:
        return []

    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def content_hash(self) -> str:
        """Every tensor's name, dtype, shape and bytes: a model in memory has no file dates to go by (about a
        second per GiB, once per run)."""
        h = hashlib.blake2b(digest_size=16)
        for name, t in self.tensors.items():
            h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
            h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _distinct(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict less the second name of a tied tensor (the LM head that is the embedding), as
    `save_pretrained` leaves it out: the first name, in module order, is the one a checkpoint stores."""
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def open_memory(model, tokenizer, folder: Path, label: str) -> MemorySource:
    """`model` (a transformers PreTrainedModel) and its tokenizer as a source whose small files are written
    into `folder` (an empty temporary folder the caller removes after the run)."""
    from transformers import AutoConfig, PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise OptionError(
            f"model is a {type(model).__name__}, not a transformers PreTrainedModel",
            fix="pass a path, a hub id, an alias or a model from transformers' from_pretrained",
        )
    if tokenizer is None:
        raise OptionError(
            "a model in memory needs its tokenizer (calibration text and the export's tokenizer files)",
            fix="fp8ptq.quantize(model, recipe, output, tokenizer=tokenizer)",
        )
    state = _distinct(model.state_dict())
    on_meta = [n for n, t in state.items() if t.is_meta]
    if on_meta:
        raise ModelError(
            f"'{label}': {len(on_meta)} weights are on the meta device ({on_meta[0]}, ...): the model was loaded "
            "with offloading or without its weights",
            fix="load it whole (from_pretrained without device_map), or pass its folder instead",
        )
    config = copy.deepcopy(model.config)  # the edits save_pretrained makes, on a copy: the model stays as it is
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(folder))
    generation = getattr(model, "generation_config", None)
    if generation is not None and model.can_generate():
        generation.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    check_architectures(config, folder)
    weight_map = dict.fromkeys(state, MEMORY)
    check_sizes(config, weight_map, folder)
    return MemorySource(path=folder, label=label, weight_map=weight_map, config=config, tensors=state)
