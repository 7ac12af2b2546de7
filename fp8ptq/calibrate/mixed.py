"""Per-layer 4/8-bit mix (FlattenQuant's idea, made automatic): measure how much each fused Linear group
suffers at 4 bit, then move the least sensitive groups to 4 bit until the budget of linear FLOPs is spent.

Sensitivity, per group (q/k/v, o, gate/up, down of every layer):
- "output": the extra squared output error on the calibration inputs, tr(D4 H D4^T) - tr(D8 H D8^T)
  with D = RTN(W) - W and H = sum of 2 x^T x over the group's float inputs: one float pass, cheap,
  scales to any model size;
- "kl": the measured end-to-end KL(float || model with only this group at 4 bit) on held-in samples:
  exact for what it measures, one full forward per group (small models).
Groups are taken in increasing sensitivity per FLOP while the 4-bit share stays within the budget.
Fused shards stay together because vLLM runs them as one GEMM with one scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8ptq.calibrate.state import CalibrationSetup, Progress, finite_stats, prepare
from fp8ptq.dist import TreeSum
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import load_float, materialize, release
from fp8ptq.ops.hessian import hessian_partial
from fp8ptq.quantization.plan import plan_layer
from fp8ptq.quantization.schemes import LinearScheme
from fp8ptq.quantization.weights import fake_quant_weight


@dataclass(frozen=True)
class MixedPlan:
    low: frozenset[str]  # full module names at the low-bit scheme
    high_scheme: LinearScheme
    low_scheme: LinearScheme
    report: dict


def _group_error(weights: list[torch.Tensor], H: torch.Tensor, args, cal) -> float:
    total = 0.0
    for w in weights:
        d = fake_quant_weight(w, args, cal) - w.float()
        total += float(((d @ H) * d).sum())
    return total


def output_sensitivity(
    src: ModelSource, recipe, ids: torch.Tensor, setup: CalibrationSetup, comm=None, progress: Progress | None = None
) -> list[dict]:
    """One float pass over all layers; per fused group: FLOPs/token and the output-error increase at 4 bit."""
    model, state = prepare(src, ids, setup, comm)
    arch = state.arch
    layers = arch.decoder_layers(model)
    out = []
    try:
        for i, layer in enumerate(layers):
            prefix = arch.layer_prefix(i)
            materialize(layer, prefix, src, torch.float32, state.device)
            src.close()
            plan = plan_layer(layer, prefix, recipe.scheme.targets, recipe.scheme.ignore, arch)
            modules = dict(layer.named_modules())
            trees = {g: TreeSum() for g in plan.groups}
            current = {}
            handles = [
                modules[g[0]].register_forward_pre_hook(
                    lambda _m, a, g=g, trees=trees, current=current: trees[g].add(current["c"], hessian_partial(a[0]))
                )
                for g in plan.groups
            ]
            try:
                with torch.inference_mode():
                    for c, first, x in state.each_chunk():
                        current["c"] = c
                        state.write(first, state.run_layer(layer, i, x, first))
            finally:
                for h in handles:
                    h.remove()
            for g in plan.groups:
                H = trees[g].total(state.comm)
                finite_stats(prefix + g[0], float(H.diagonal().max()), H)
                ws = [modules[n].weight.data for n in g]
                e_low = _group_error(ws, H, recipe.mixed.weights, recipe.calibration)
                e_high = _group_error(ws, H, recipe.scheme.weights, recipe.calibration)
                out.append(
                    {
                        "modules": [prefix + n for n in g],
                        "flops": sum(w.numel() for w in ws),
                        "sensitivity": max(e_low - e_high, 0.0),
                    }
                )
            release(layer)
            if progress:
                progress("sensitivity", i + 1, len(layers))
    finally:
        state.store.close()
    return out


def kl_sensitivity(
    src: ModelSource, recipe, ids: torch.Tensor, groups: list[dict], progress: Progress | None = None
) -> None:
    """Replace each group's sensitivity with the measured KL of the float model with only it at 4 bit."""
    import torch.nn.functional as F

    model = load_float(src)
    modules = dict(model.named_modules())
    with torch.inference_mode():
        ref = F.log_softmax(model(ids).logits.float(), -1)
        for k, g in enumerate(groups):
            saved = [modules[n].weight.data for n in g["modules"]]
            for n in g["modules"]:
                modules[n].weight.data = fake_quant_weight(
                    modules[n].weight.data, recipe.mixed.weights, recipe.calibration
                )
            lq = F.log_softmax(model(ids).logits.float(), -1)
            g["sensitivity"] = float((ref.exp() * (ref - lq)).sum(-1).mean())
            for n, w in zip(g["modules"], saved):
                modules[n].weight.data = w
            if progress:
                progress("sensitivity", k + 1, len(groups))


def choose_low(groups: list[dict], fraction: float) -> tuple[set[str], float]:
    """Greedy by sensitivity per FLOP: add groups while the low-bit FLOP share stays <= fraction."""
    total = sum(g["flops"] for g in groups)
    budget = fraction * total
    low, used = set(), 0
    for g in sorted(groups, key=lambda g: (g["sensitivity"] / g["flops"], g["modules"][0])):
        if used + g["flops"] <= budget * (1 + 1e-9):
            low.update(g["modules"])
            used += g["flops"]
    return low, used / total if total else 0.0


def plan_mixed(
    src: ModelSource, recipe, ids: torch.Tensor, setup: CalibrationSetup, comm=None, progress: Progress | None = None
) -> MixedPlan:
    m = recipe.mixed
    groups = output_sensitivity(src, recipe, ids, setup, comm, progress)
    if m.sensitivity == "kl":
        kl_ids = ids[: min(4, ids.shape[0]), : min(256, ids.shape[1])]
        kl_sensitivity(src, recipe, kl_ids, groups, progress)
    low, share = choose_low(groups, m.int4_fraction)
    report = {
        "sensitivity": m.sensitivity,
        "int4_fraction_target": m.int4_fraction,
        "int4_flop_share": share,
        "groups": [{**g, "bits": 4 if g["modules"][0] in low else 8} for g in groups],
    }
    return MixedPlan(
        frozenset(low),
        recipe.linear_scheme(),
        recipe.low_scheme(),
        report,
    )
