"""Exact float transforms applied to a decoder layer before it is quantized (recipe `smooth`, `flatten`).

One observe pass over the float layer (inputs from the already-quantized layers below) gives the
statistics both transforms need (outliers/stats.py); the transforms then rewrite the layer's weights
in place and record the changed tensors in the LayerResult, and quantization proceeds on the
transformed layer as usual.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8ptq.calibrate.pipeline import LayerResult, RunState, observe_layer
from fp8ptq.models.loader import ModelSource
from fp8ptq.outliers.flatten import apply_flatten, flattened_amax, flattened_width, plan_flatten
from fp8ptq.outliers.smooth import choose_alpha, fold, smooth_scales
from fp8ptq.outliers.stats import StatsSpec
from fp8ptq.quantize.schemes import act_grid, fake_quant_weight, input_quantizer
from fp8ptq.recipe import Recipe

# norm -> the fused group it feeds (Llama-family layers)
_SMOOTH_GROUPS = {"qkv": ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                  "gate_up": ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"))}
SMOOTH_ROWS = 2048  # calibration rows for the alpha search


def make_transforms(recipe: Recipe, src: ModelSource) -> Callable | None:
    if recipe.smooth is None and recipe.flatten is None:
        return None

    def apply(layer: torch.nn.Module, index: int, prefix: str, state: RunState, result: LayerResult) -> None:
        stats = observe_layer(layer, prefix, state, StatsSpec(rows=SMOOTH_ROWS if recipe.smooth else 0), kv=False)
        report = {}
        if recipe.smooth is not None:
            report["smooth"] = smooth_layer(layer, prefix, stats, recipe, src, result)
        if recipe.flatten is not None:
            report["flatten"] = flatten_layer(layer, prefix, stats, recipe, result)
        result.report["transforms"] = report

    return apply


def _act_quant(recipe: Recipe):
    acts = recipe.scheme.input_activations
    grid = act_grid(acts)
    if acts.dynamic:
        q = input_quantizer(acts, None)
        return lambda x, _amax: q(x)
    return lambda x, amax: grid.fake_quant(x, grid.scale(amax))


def smooth_layer(layer, prefix: str, stats: dict, recipe: Recipe, src: ModelSource, result: LayerResult) -> dict:
    modules = dict(layer.named_modules())
    wq = lambda w: fake_quant_weight(w, recipe.scheme.weights, recipe.calibration)  # noqa: E731
    out = {}
    for key in recipe.smooth.groups:
        norm_name, names = _SMOOTH_GROUPS[key]
        st = stats.get(names[0])
        if st is None:
            continue
        weights = [modules[n].weight.data for n in names]
        rows = st.rows.to(weights[0].device)
        if recipe.smooth.alpha == "auto":
            alpha, errors = choose_alpha(rows, st.channel_amax, weights, recipe.smooth.alphas, _act_quant(recipe), wq)
        else:
            alpha, errors = recipe.smooth.alpha, {}
        out[key] = {"alpha": alpha, "errors": errors}
        if alpha is None:
            continue
        w_amax = torch.stack([w.float().abs().amax(dim=0) for w in weights]).amax(dim=0)
        s = smooth_scales(st.channel_amax.to(w_amax.device), w_amax, alpha)
        norm = modules[norm_name]
        full_norm = f"{prefix}{norm_name}.weight"
        new_norm, new_weights, s_eff = fold(norm.weight.data, weights, s, src.tensor_dtype(full_norm))
        norm.weight.data = new_norm.to(norm.weight.dtype)
        result.float_tensors[full_norm] = new_norm
        for n, w in zip(names, new_weights):
            modules[n].weight.data = w.to(modules[n].weight.dtype)
            result.float_tensors[f"{prefix}{n}.weight"] = w
        out[key]["input_amax"] = {"before": st.amax, "after": float((st.channel_amax.cpu() / s_eff.cpu()).max())}
    return out


def flatten_layer(layer, prefix: str, stats: dict, recipe: Recipe, result: LayerResult) -> dict:
    cfg = recipe.flatten
    mlp = layer.mlp
    st = stats["mlp.down_proj"]
    width = mlp.down_proj.in_features
    new_width = flattened_width(width, cfg.extra_channels, cfg.multiple, cfg.tp)
    plan = plan_flatten(st.channel_amax, new_width)
    g, u, d = apply_flatten(mlp.gate_proj.weight.data, mlp.up_proj.weight.data, mlp.down_proj.weight.data, plan)
    for name, lin, w in (("gate_proj", mlp.gate_proj, g), ("up_proj", mlp.up_proj, u), ("down_proj", mlp.down_proj, d)):
        assert lin.bias is None or name == "down_proj", "flattening MLPs with gate/up biases is not supported"
        lin.weight = torch.nn.Parameter(w.contiguous(), requires_grad=False)
        lin.in_features, lin.out_features = w.shape[1], w.shape[0]
        result.float_tensors[f"{prefix}mlp.{name}.weight"] = w
    split = plan.pieces[plan.pieces > 1]
    return {"width": new_width, "old_width": width, "channels_split": int(split.numel()),
            "max_pieces": int(plan.pieces.max()), "input_amax": {"before": st.amax, "after": flattened_amax(st.channel_amax, plan)}}
