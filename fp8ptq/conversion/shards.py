"""Shard-at-a-time rewriting of a safetensors checkpoint into compressed-tensors, shared by the GPTQ, AWQ and
ModelOpt converters: each source shard becomes one output shard; a quantized module's tensors are read by
name wherever they lie (a module may straddle shards) and converted when its anchor tensor comes by."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8ptq.conversion.gguf_ct import quantization_config
from fp8ptq.errors import ModelError
from fp8ptq.io import write_json_atomic
from fp8ptq.models.folder import side_files
from fp8ptq.models.loader import check_finite, read_weight_map
from fp8ptq.quantization.schemes import LinearScheme

SIDE_FILES = ("config.json", "model.safetensors.index.json", "quantize_config.json", "hf_quant_config.json")


@dataclass
class Converted:
    """What one module became: its output tensors (full names), a report record and the scheme it is under."""

    tensors: dict[str, torch.Tensor]
    record: dict
    scheme: LinearScheme | None = None


@dataclass
class Source:
    path: Path
    weight_map: dict[str, str] = field(default_factory=dict)
    side_files: list[Path] = field(default_factory=list)

    def __post_init__(self):
        self.weight_map = read_weight_map(self.path)
        self.side_files = side_files(self.path)  # checked before any output exists (models/folder.py)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise ModelError(f"tensor '{name}' is missing from '{self.path}'", fix="check that the checkpoint is whole")
        with safe_open(str(self.path / self.weight_map[name]), framework="pt") as h:
            return h.get_tensor(name)


def rewrite(
    src: Source,
    tmp: Path,
    anchor: str,
    owned: tuple[str, ...],
    convert_module: Callable[[Source, str], Converted],
) -> tuple[list[dict], dict]:
    """Write every tensor of `src` into `tmp`: modules with an `anchor` tensor (e.g. `.qweight`) go through
    `convert_module(src, module)`, their other `owned` suffixes are consumed by it, the rest is copied.
    Returns the report records and {scheme key: (scheme, [modules])}."""
    modules = {n.removesuffix(anchor) for n in src.weight_map if n.endswith(anchor)}
    shards = sorted(set(src.weight_map.values()))
    records, schemes, out_map, total = [], {}, {}, 0
    for i, shard in enumerate(shards):
        out: dict[str, torch.Tensor] = {}
        with safe_open(str(src.path / shard), framework="pt") as h:  # open once per shard, not per tensor
            for name in h.keys():
                base = next((name.removesuffix(s) for s in owned if name.endswith(s)), None)
                if base is not None and base in modules:
                    if not name.endswith(anchor):
                        continue  # read by convert_module with its anchor
                    c = convert_module(src, base)
                    out.update(c.tensors)
                    records.append({"module": base, **c.record})
                    if c.scheme is not None:
                        key = json.dumps(
                            [c.scheme.weights.model_dump(), None if c.scheme.input_activations is None else
                             c.scheme.input_activations.model_dump()], default=str)  # fmt: skip
                        schemes.setdefault(key, (c.scheme, []))[1].append(base)
                else:
                    out[name] = check_finite(name, h.get_tensor(name))
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / file), metadata={"format": "pt"})
        out_map.update({k: file for k in out})
        total += (tmp / file).stat().st_size
    write_json_atomic(
        tmp / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(out_map.items()))},
        trailing_newline=True,
    )
    return records, schemes


def finish(src: Source, tmp: Path, config: dict, schemes: dict, report: dict, kv: dict | None = None) -> dict:
    """config.json with compressed-tensors' quantization_config (and `kv`, its kv_cache_scheme), side files
    copied, conversion.json."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    qc = quantization_config({k: (s, sorted(m)) for k, (s, m) in schemes.items()})
    if qc is not None:
        config["quantization_config"] = qc
        if kv is not None:
            qc["kv_cache_scheme"] = kv
    write_json_atomic(tmp / "config.json", config, trailing_newline=True)
    for f in src.side_files:  # tokenizer, generation config, chat template ...
        if f.name not in SIDE_FILES:
            shutil.copy2(f, tmp / f.name)
    write_json_atomic(tmp / "conversion.json", report, trailing_newline=True)
    return report
