"""Exact float transforms applied to a decoder layer before it is quantized (recipe `smooth`, `flatten`).

One observe pass over the float layer (inputs from the already-quantized layers below) gives the
statistics both transforms need (outliers/stats.py); the transforms then rewrite the layer's weights
in place and record the changed tensors in the LayerResult, and quantization proceeds on the
transformed layer as usual.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8ptq.calibrate.state import RunState, observe_layer
from fp8ptq.errors import RecipeError
from fp8ptq.models.arch import SmoothGroup
from fp8ptq.models.loader import ModelSource
from fp8ptq.outliers.flatten import apply_flatten, flattened_amax, flattened_width, plan_flatten
from fp8ptq.outliers.smooth import awq_stats, choose_alpha, fold, smooth_scales, weight_amax
from fp8ptq.outliers.stats import StatsSpec
from fp8ptq.quantization.numerics import input_quantizer
from fp8ptq.quantization.results import LayerResult
from fp8ptq.quantization.schemes import dynamic_inputs, handler
from fp8ptq.quantization.weights import fake_quant_weight

SMOOTH_ROWS = 2048  # calibration rows for the alpha search


def make_transforms(recipe, src: ModelSource) -> Callable | None:
    """The recipe's exact transforms as one per-layer function (None when it has none). Which norm
    feeds which Linears, and which MLP may be widened, the model's architecture adapter says."""
    if recipe.smooth is None and recipe.flatten is None:
        return None
    arch = src.arch

    def apply(layer: torch.nn.Module, index: int, state: RunState, result: LayerResult) -> None:
        stats = observe_layer(layer, index, state, StatsSpec(rows=SMOOTH_ROWS if recipe.smooth else 0), kv=False)
        report = {}
        if recipe.smooth is not None:
            report["smooth"] = smooth_layer(layer, result.prefix, stats, recipe, src, result)
        if recipe.flatten is not None:
            if arch.flatten is None:
                raise RecipeError(
                    f"recipe '{recipe.name}' flattens the MLP, which {arch.described} "
                    "does not support (no separate gate/up/down Linears)",
                    fix="use a recipe without a flatten section",
                )
            report["flatten"] = flatten_layer(layer, result.prefix, stats, recipe, result, arch.flatten)
        result.report["transforms"] = report

    return apply


def _act_quant(recipe):
    acts = recipe.scheme.input_activations
    if acts is None:  # weight-only (smooth.method awq): the inputs stay as they are (choose_alpha's Gram path)
        return None
    grid = handler(acts).act_grid(acts)
    if dynamic_inputs(acts):
        q = input_quantizer(acts, None)
        return lambda x, _amax: q(x)
    return lambda x, amax: grid.fake_quant(x, grid.scale(amax))


def smooth_layer(layer, prefix: str, stats: dict, recipe, src: ModelSource, result: LayerResult) -> dict:
    arch = src.arch
    modules = dict(layer.named_modules())
    # Candidates are scored with the recipe's own weight rounding. Where that is a scale search (NVFP4's
    # costs ~25x min-max rounding), every candidate is screened with min-max weights and only the best
    # RESCORE (outliers/smooth.py) are scored with the search (BENCHMARKS.md, NVFP4 smoothing search).
    wq = lambda w: fake_quant_weight(w, recipe.scheme.weights, recipe.calibration)  # noqa: E731
    screen = None
    if recipe.calibration.weight_observer != "minmax":
        minmax = recipe.calibration.model_copy(update={"weight_observer": "minmax"})
        screen = lambda w: fake_quant_weight(w, recipe.scheme.weights, minmax)  # noqa: E731
    groups = {g.key: g for g in arch.smooth_groups(layer, prefix)}
    if arch.flatten is not None:  # down_proj's input is up_proj's output: s folds into up's rows
        groups["down"] = SmoothGroup("down", arch.flatten.up, (arch.flatten.down,))
    out = {}
    for key in recipe.smooth.groups:
        if key not in groups:
            continue  # this family has no such group (reported: absent from the layer's smooth report)
        norm_name, names = groups[key].norm, groups[key].linears
        st = stats.get(names[0])
        if st is None:
            continue
        weights = [modules[n].weight.data for n in names]
        rows = st.rows.to(weights[0].device)
        if recipe.smooth.method == "awq":
            x_stat, w_stat = awq_stats(rows, weights)
        else:
            x_stat, w_stat = st.channel_amax, weight_amax(weights)
        if recipe.smooth.alpha == "auto":
            alpha, errors = choose_alpha(
                rows,
                x_stat,
                weights,
                recipe.smooth.alphas,
                _act_quant(recipe),
                wq,
                screen_quant=screen,
                w_stat=w_stat,
            )
        else:
            alpha, errors = recipe.smooth.alpha, {}
        out[key] = {"alpha": alpha, "errors": errors}
        if alpha is None:
            continue
        s = smooth_scales(x_stat.to(w_stat.device), w_stat, alpha)
        if key == "down":
            s_eff = _fold_into_rows(modules[norm_name], [modules[n] for n in names], s, f"{prefix}{norm_name}", result)
            result.float_tensors.update({f"{prefix}{n}.weight": modules[n].weight.data.float() for n in names})
            out[key]["input_amax"] = {"before": st.amax, "after": float((st.channel_amax.cpu() / s_eff.cpu()).max())}
            continue
        norm = modules[norm_name]
        full_norm = f"{prefix}{norm_name}.weight"
        offset = arch.norm_offset if groups[key].offset is None else groups[key].offset
        new_norm, new_weights, s_eff = fold(norm.weight.data, weights, s, src.tensor_dtype(full_norm), offset)
        norm.weight.data = new_norm.to(norm.weight.dtype)
        result.float_tensors[full_norm] = new_norm
        for n, w in zip(names, new_weights):
            modules[n].weight.data = w.to(modules[n].weight.dtype)
            result.float_tensors[f"{prefix}{n}.weight"] = w
        out[key]["input_amax"] = {"before": st.amax, "after": float((st.channel_amax.cpu() / s_eff.cpu()).max())}
    return out


def _fold_into_rows(prev, linears, s: torch.Tensor, prev_name: str, result: LayerResult) -> torch.Tensor:
    """x' = x / s where x is Linear `prev`'s output (its rows and bias divided by s), W' = W * s for the
    Linears reading it: exact in fp32 (both sides are quantized after). Returns s."""
    w = prev.weight.data.float() / s.to(prev.weight.device)[:, None]
    prev.weight.data = w.to(prev.weight.dtype)
    result.float_tensors[f"{prev_name}.weight"] = w
    if getattr(prev, "bias", None) is not None:
        b = prev.bias.data.float() / s.to(prev.bias.device)
        prev.bias.data = b.to(prev.bias.dtype)
        result.float_tensors[f"{prev_name}.bias"] = b
    for lin in linears:
        lin.weight.data = (lin.weight.data.float() * s.to(lin.weight.device)[None, :]).to(lin.weight.dtype)
    return s


def flatten_layer(layer, prefix: str, stats: dict, recipe, result: LayerResult, target) -> dict:
    cfg = recipe.flatten
    gate, up, down = (layer.get_submodule(n) for n in (target.gate, target.up, target.down))
    st = stats[target.down]
    width = down.in_features
    new_width = flattened_width(width, cfg.extra_channels, cfg.multiple, cfg.tp)
    plan = plan_flatten(st.channel_amax, new_width)
    g, u, d = apply_flatten(gate.weight.data, up.weight.data, down.weight.data, plan)
    for name, lin, w in ((target.gate, gate, g), (target.up, up, u), (target.down, down, d)):
        if lin.bias is not None and name != target.down:
            raise RecipeError(
                f"{prefix}{name} has a bias: flattening MLPs with gate/up biases is not supported",
                fix="use a recipe without a flatten section",
            )
        lin.weight = torch.nn.Parameter(w.contiguous(), requires_grad=False)
        lin.in_features, lin.out_features = w.shape[1], w.shape[0]
        result.float_tensors[f"{prefix}{name}.weight"] = w
    split = plan.pieces[plan.pieces > 1]
    return {
        "width": new_width,
        "old_width": width,
        "channels_split": int(split.numel()),
        "max_pieces": int(plan.pieces.max()),
        "input_amax": {"before": st.amax, "after": flattened_amax(st.channel_amax, plan)},
    }
