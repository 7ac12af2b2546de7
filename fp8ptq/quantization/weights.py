"""Weight quantization of one fused group, RTN or GPTQ, on the grid its scheme handler gives."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from compressed_tensors.quantization import QuantizationArgs

from fp8ptq.ops.gptq import gptq
from fp8ptq.ops.granularity import TENSOR
from fp8ptq.ops.intq import check_group_size
from fp8ptq.ops.weight_grid import WeightGrid
from fp8ptq.quantization.schemes import granularity, handler


@dataclass
class QuantizedWeight:
    fake: torch.Tensor  # fp32 [out, in], exactly on the grid described by params
    params: dict[str, torch.Tensor]  # weight_scale [, weight_zero_point] as compressed-tensors stores them
    report: dict


def export_format(weights: QuantizationArgs, acts: QuantizationArgs | None) -> str:
    """compressed-tensors format of a Linear (its weights' handler decides)."""
    return handler(weights).format(weights, acts)


def weight_grid(args: QuantizationArgs, cal, w: torch.Tensor | None = None, weight_only: bool = False) -> WeightGrid:
    """The scheme's grid for weight w (two-level formats take their global scale from w; weight_only:
    no input quantization, see SchemeHandler.weight_grid)."""
    h = handler(args)
    return h.weight_grid(args, cal, None if w is None else h.global_scale(args, w), weight_only=weight_only)


def _rtn(w: torch.Tensor, grid: WeightGrid) -> tuple[torch.Tensor, dict]:
    if grid.group_size is None:
        scale, zp = grid.choose(w)
        return grid.fake_quant(w, (scale, zp)), _params(scale, zp)
    n = grid.group_size
    groups = w.reshape(w.shape[0], -1, n).transpose(0, 1).reshape(-1, n)  # [(in/n)*out, n]: rows per group
    scale, zp = grid.choose(groups)
    unflat = lambda t: t.reshape(-1, w.shape[0], t.shape[-1]).transpose(0, 1)  # noqa: E731
    if grid.refine is not None:  # params that depend on the whole row: refine [out, in/n], then re-flatten
        flat = lambda t: None if t is None else t.T.reshape(-1, 1)  # noqa: E731
        refined = grid.refine(
            (unflat(scale).reshape(w.shape[0], -1), None if zp is None else unflat(zp).reshape(w.shape[0], -1))
        )
        scale, zp = flat(refined[0]), flat(refined[1])
    q = grid.fake_quant(groups, (scale, zp))
    q = unflat(q).reshape(w.shape)
    scale = unflat(scale).reshape(w.shape[0], -1)
    zp = None if zp is None else unflat(zp).reshape(w.shape[0], -1)
    return q, _params(scale, zp)


def check_block_size(shapes: dict[str, tuple[int, int]], b: tuple[int, int]) -> None:
    """Every weight [out, in] of a block scheme must be whole blocks: vLLM quantizes its inputs in groups
    of the block width (per_token_group_quant_fp8 asserts in % B == 0) and refuses fused shards whose
    out is not a multiple of B (validate_fp8_block_shape). fp8ptq also asks it of unfused Linears, whose
    partial edge block vLLM and compressed-tensors would pad, so that one rule covers every Linear."""
    for name, (out_f, in_f) in shapes.items():
        if out_f % b[0] or in_f % b[1]:
            raise ValueError(
                f"{name} [{out_f}, {in_f}] is not whole {b[0]}x{b[1]} blocks (block sizes that divide "
                f"both: {', '.join(map(str, valid_block_sizes([out_f, in_f]))) or 'none'})"
            )


def valid_block_sizes(widths: list[int]) -> list[int]:
    """Powers of two in 8..1024 dividing every width."""
    return [b for b in (8 << i for i in range(8)) if all(w % b == 0 for w in widths)]


def fake_quant_weight(w: torch.Tensor, args: QuantizationArgs, cal) -> torch.Tensor:
    """Round-to-nearest fake quantization of one weight [out, in] with the scheme's own grid."""
    return _rtn(w.float(), weight_grid(args, cal, w))[0]


def _params(scale: torch.Tensor, zp: torch.Tensor | None) -> dict:
    return {"weight_scale": scale} if zp is None else {"weight_scale": scale, "weight_zero_point": zp}


@dataclass
class SolvedGroup:
    """One fused group as its solver left it, before it is split into shards: the stacked float weights
    `w`, their fake-quant `q` and the grid with the params actually used (`scale`, `zero_point`: the
    grid's own, before a two-level format's global scale). A rounding refinement (calibrate/signround.py)
    moves `q` to other codes of the same params and splits again."""

    names: list[str]
    rows: list[int]
    w: torch.Tensor
    q: torch.Tensor
    grid: WeightGrid
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    args: QuantizationArgs
    start: torch.Tensor | None = None  # where the solver rounded each weight from (GPTQ: error-updated)
    # GPTQ: (the codes it chose, each row's output error of them [out] fp64: GPTQResult.out_err). split_group
    # reads it while `q` is still those codes; once a refinement sets q to others it computes the error itself
    solver_err: tuple[torch.Tensor, torch.Tensor] | None = None


def fake_quant_with(w: torch.Tensor, group: SolvedGroup) -> torch.Tensor:
    """w [out, in] on `group`'s grid with its params as solved (no scale is chosen again)."""
    grid, scale, zp = group.grid, group.scale, group.zero_point
    if grid.group_size is None:
        return grid.fake_quant(w, (scale, zp))
    n = grid.group_size
    flat = lambda t: None if t is None else t.reshape(-1, 1)  # noqa: E731
    # one row per (output row, group), in w's own order: fake_quant is elementwise given each row's params
    return grid.fake_quant(w.reshape(-1, n), (flat(scale), flat(zp))).reshape(w.shape)


def solve_group(
    weights: dict[str, torch.Tensor],
    args: QuantizationArgs,
    cal,
    H: torch.Tensor | None,
    weight_only: bool = False,
) -> SolvedGroup:
    """Solve one fused group's stacked weights, RTN or GPTQ (see quantize_group)."""
    names = list(weights)
    w = torch.cat([weights[n].float() for n in names])
    g = granularity(args)
    if g.kind == "group":
        check_group_size(w.shape[1], g.group_size)
    if g.kind == "block":
        check_block_size({n: tuple(weights[n].shape) for n in names}, g.block)
    grid = weight_grid(args, cal, w, weight_only)
    if cal.weight_method == "gptq":
        assert H is not None, "GPTQ needs the input Hessian"
        r = gptq(w, H, grid, block_size=cal.gptq_block_size, damp=cal.gptq_damp, act_order=cal.gptq_act_order)
        q, scale, zp, start, err = r.weight, r.scale, r.zero_point, r.updated, (r.weight, r.out_err)
    else:
        q, params = _rtn(w, grid)
        scale, zp, start, err = params["weight_scale"], params.get("weight_zero_point"), w, None
    return SolvedGroup(names, [weights[n].shape[0] for n in names], w, q, grid, scale, zp, args, start, err)


def quantize_group(
    weights: dict[str, torch.Tensor],
    args: QuantizationArgs,
    cal,
    H: torch.Tensor | None,
    weight_only: bool = False,
) -> dict[str, QuantizedWeight]:
    """Quantize one fused group's weights (names -> [out, in]), RTN or GPTQ (needs H, the sum of 2 x^T x
    over the group's inputs). cal: the recipe's calibration section; weight_only: the scheme has no input
    quantization (the engine's weight-only kernels load scales in the model dtype).

    The group's rows are stacked and solved as one matrix: they share the input (one Hessian), and a
    per-tensor scale of the stack is the scale the shards must share (vLLM runs them as one GEMM and
    would otherwise requantize them to the max scale, a second rounding).
    """
    return split_group(solve_group(weights, args, cal, H, weight_only), H)


def split_group(solved: SolvedGroup, H: torch.Tensor | None) -> dict[str, QuantizedWeight]:
    """A solved group's shards as compressed-tensors stores them, with their error reports."""
    args, names, rows, w, q = solved.args, solved.names, solved.rows, solved.w, solved.q
    g = granularity(args)
    params = _params(solved.scale, solved.zero_point)
    gs = handler(args).global_scale(args, w)
    if gs is not None:  # two-level: stored group scales are eff * global (exact: eff = s / global)
        params["weight_scale"] = (params["weight_scale"] * gs).to(torch.float8_e4m3fn).float()
    out, numbers = {}, []
    for name, q_i, w_i, lo in zip(names, q.split(rows), w.split(rows), [sum(rows[:i]) for i in range(len(rows))]):
        p_i = {k: (v if g == TENSOR else v[lo : lo + w_i.shape[0]]).clone() for k, v in params.items()}
        if g.kind == "block":  # the grid's per-row scales, one per row of each block -> one per block
            p_i = {k: v[:: g.block[0]].contiguous() for k, v in p_i.items()}
        if gs is not None:
            p_i["weight_global_scale"] = gs.clone()  # one for every shard of a fused group (vLLM takes the max)
        report = {"weight_rel_err": (q_i - w_i).norm() / w_i.norm().clamp_min(1e-12)}
        if H is not None:  # relative output error on the calibration inputs: tr(D H D^T) / tr(W H W^T)
            if solved.solver_err is not None and solved.solver_err[0] is q:  # GPTQ's own: one [out, in] x [in, in]
                err = solved.solver_err[1][lo : lo + w_i.shape[0]].sum().float().clamp_min(0)  # product less
            else:
                d = q_i - w_i
                err = ((d @ H) * d).sum().clamp_min(0)
            ref = ((w_i @ H) * w_i).sum().clamp_min(1e-12)
            report["output_rel_err"] = err.sqrt() / ref.sqrt()
        numbers.append(report)
        out[name] = QuantizedWeight(q_i.contiguous(), p_i, report)
    # the group's report numbers to floats in one transfer (one host sync per group, not two per Linear)
    values = iter(torch.stack([v for r in numbers for v in r.values()]).tolist())
    for r in numbers:
        r.update((k, next(values)) for k in r)
    return out
