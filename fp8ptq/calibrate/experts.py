"""Calibrating a mixture-of-experts block: every expert, on the tokens the router really sends it.

The experts of one block that share a leaf pattern (all gate/up groups, then all down groups) form one
*expert stage*, run in the pipeline where the first of them executes (models/moe.py holds the experts as
separate Linears, named as on disk). For an expert stage:

1. routing pass (once per block): norm + router over every chunk, counting the (token, expert) pairs;
2. experts the router sends fewer than `calibration.moe_min_tokens` tokens (zero included) are
   *starved*: during this block's stats passes they run on every token of the calibration set, so
   their statistics and GPTQ Hessian come from all tokens, while the block's output still uses only
   the tokens routed to them (the real routing). No expert is left unquantized or NaN-scaled;
3. stats passes over batches of experts (per-expert input abs-max and Hessian; a batch holds as many
   Hessians as fit `HESSIAN_BUDGET`, so a 128-expert layer never holds 128 of them; only the batch's
   experts run), each batch's weights quantized right after its pass (an expert's inputs do not
   depend on other experts' weights);
4. static input scales are shared by all experts of the stage: vLLM's FusedMoE takes the maximum over
   experts of w13_input_scale / w2_input_scale (process_fp8_input_tensor_strategy_moe, vLLM 0.32), so
   fp8ptq writes that one scale everywhere and simulates exactly what the engine computes. It is the
   min-max scale of all experts' inputs (an MSE search would need one row set across experts).

Per-expert token counts and the starved experts go into the layer report and the manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from fp8ptq.calibrate.observers import OBSERVERS
from fp8ptq.calibrate.state import Stop, describe, finite_stats
from fp8ptq.dist import TreeSum
from fp8ptq.models.moe import token_counts
from fp8ptq.ops.hessian import hessian_partial
from fp8ptq.outliers.stats import ActStats, StatsSpec
from fp8ptq.quantization.numerics import input_quantizer
from fp8ptq.quantization.results import QuantizedLinear
from fp8ptq.quantization.schemes import dynamic_inputs, handler
from fp8ptq.quantization.weights import quantize_group

HESSIAN_BUDGET = 512 << 20  # bytes of expert Hessians (with their tree partials) held at once


@dataclass(frozen=True)
class ExpertStage:
    """All experts' groups of one leaf pattern in one MoE block, e.g. every (gate_proj, up_proj)."""

    path: str  # the experts module, relative to the layer ("mlp.experts")
    experts: tuple[int, ...]
    groups: tuple[tuple[str, ...], ...]  # one per expert, same order as `experts`


def expert_of(name: str, arch) -> tuple[str, int, str] | None:
    """(experts path, expert index, leaf) of a Linear inside an expert list, else None."""
    for path in arch.expert_lists:
        m = re.fullmatch(re.escape(path) + r"\.(\d+)\.(.+)", name)
        if m:
            return path, int(m.group(1)), m.group(2)
    return None


def merge_expert_stages(order: list[list], plan, arch) -> list[list]:
    """Replace the traced expert groups by one ExpertStage per (experts path, leaves), placed where the
    first of them ran; experts the trace did not reach are included (the stage holds every planned one)."""
    if not arch.expert_lists:
        return order

    def key(g) -> tuple | None:  # (experts path, leaves) of an expert's group, else None
        where = expert_of(g[0], arch) if isinstance(g, tuple) else None
        return None if where is None else (where[0], tuple(expert_of(n, arch)[2] for n in g))

    stages: dict[tuple, list] = {}
    for g in plan.groups:
        if (k := key(g)) is not None:
            stages.setdefault(k, []).append((expert_of(g[0], arch)[1], g))
    out = []
    for block in order:
        merged, placed = [], set()
        for g in block:
            k = key(g)
            if k is None:
                merged.append(g)
                continue
            if k not in placed:
                placed.add(k)
                members = sorted(stages[k])
                merged.append(ExpertStage(k[0], tuple(e for e, _ in members), tuple(g for _, g in members)))
        out.append(merged)
    return out


def routing_counts(cal, block, experts) -> list[int]:
    """(token, expert) pairs per expert over the whole calibration set (all ranks)."""
    total = torch.zeros(len(experts), dtype=torch.long)

    def hook(_m, args):
        total.add_(token_counts(args[1], len(experts)))
        raise Stop

    handle = experts.register_forward_pre_hook(hook)
    try:
        cal._pass(block)
    finally:
        handle.remove()
    parts = cal.state.comm.gather_objects(total.tolist())
    return [sum(p[e] for p in parts) for e in range(len(experts))]


def quantize_expert_stage(cal, block, stage: ExpertStage) -> None:
    """Steps 2-4 of the module doc for one stage of a LayerCalibrator `cal`."""
    experts = cal.modules[stage.path]
    counts = cal.routes.get(stage.path)
    if counts is None:
        counts = cal.routes[stage.path] = routing_counts(cal, block, experts)
    cfg = cal.recipe.calibration
    starved = frozenset(e for e in stage.experts if counts[e] < max(1, cfg.moe_min_tokens))
    width = cal.modules[stage.groups[0][0]].in_features
    gptq = cfg.weight_method == "gptq"
    per_pass = max(1, HESSIAN_BUDGET // (3 * 4 * width * width)) if gptq else len(stage.groups)
    amax: dict[tuple, float] = {}
    experts.observe_all = starved
    try:
        for lo in range(0, len(stage.groups), per_pass):
            batch = list(zip(stage.experts[lo : lo + per_pass], stage.groups[lo : lo + per_pass]))
            stats, hess = _stats_pass(cal, block, experts, batch, gptq)
            for e, g in batch:
                st = stats[g].reduce(cal.state.comm)
                H = None if hess is None else hess[g].total(cal.state.comm)
                finite_stats(cal.plan.prefix + g[0], st.amax, H)
                amax[g] = st.amax
                _quantize_weights(cal, g, H, tokens=counts[e], all_tokens=e in starved, amax=st.amax)
    finally:
        experts.observe_all = frozenset()
    _install_shared_inputs(cal, stage, amax)
    report = cal.result.report.setdefault("experts", {}).setdefault(
        cal.plan.prefix + stage.path, {"tokens": counts, "min_tokens": cfg.moe_min_tokens}
    )
    report["all_tokens"] = sorted(starved)


def _stats_pass(cal, block, experts, batch, gptq: bool):
    """One pass: per-expert abs-max (and Hessian partials) at the input of each group in `batch`."""
    stats = {g: ActStats(StatsSpec(), cal.modules[g[0]].in_features, 1, 1) for _, g in batch}
    hess = {g: TreeSum() for _, g in batch} if gptq else None

    def hook_for(g):
        def hook(_m, args):
            c, first = cal.chunk
            x = args[0].reshape(1, -1, args[0].shape[-1])
            stats[g].update(c, first, x)
            if hess is not None:
                hess[g].add(c, hessian_partial(x))

        return hook

    handles = [cal.modules[g[0]].register_forward_pre_hook(hook_for(g)) for _, g in batch]
    experts.only = frozenset(e for e, _ in batch)  # nothing is written: the other experts need not run
    try:
        cal._pass(block)
    finally:
        experts.only = None
        for h in handles:
            h.remove()
    return stats, hess


def _quantize_weights(cal, group, H, *, tokens: int, all_tokens: bool, amax: float) -> None:
    scheme = cal.schemes[group]
    weights = {n: cal.modules[n].weight.data.float() for n in group}  # bf16 passes: solved in fp32
    weight_only = scheme.input_activations is None
    for name, qw in quantize_group(weights, scheme.weights, cal.recipe.calibration, H, weight_only).items():
        cal.modules[name].weight.data = qw.fake.to(cal.modules[name].weight.dtype)
        report = dict(qw.report, input_amax=amax, scheme=describe(scheme), tokens=tokens, all_tokens=all_tokens)
        cal.result.linears[cal.plan.prefix + name] = QuantizedLinear(qw.fake, dict(qw.params), scheme, report)


def _install_shared_inputs(cal, stage: ExpertStage, amax: dict) -> None:
    """The engine's input quantizer on every expert group; static scales shared (max over experts)."""
    static = {}
    for g in stage.groups:
        acts = cal.schemes[g].input_activations
        if acts is None:
            continue
        if dynamic_inputs(acts):
            cal._install_input_quant(g, input_quantizer(acts, None))
            continue
        key = acts.model_dump_json()
        if key not in static:
            members = [h for h in stage.groups if cal.schemes[h].input_activations == acts]
            shared = ActStats(StatsSpec(), 1, 1, 1)
            shared.channel_amax = torch.tensor([max(amax[h] for h in members)])
            static[key] = OBSERVERS["minmax"](shared, handler(acts).act_grid(acts))
        choice = static[key]
        for n in g:
            linear = cal.result.linears[cal.plan.prefix + n]
            linear.params["input_scale"] = choice.scale
            linear.report["input_clip_ratio"] = choice.clip_ratio
            linear.report["input_amax_shared"] = choice.amax
        cal._install_input_quant(g, input_quantizer(acts, choice.scale))
