"""What an FP8 / INT8 / INT4 recipe entry means, in one place: grids, input quantizers, weight
quantization (RTN or GPTQ) and the compressed-tensors format. Calibration, export and evaluation all
call these, so the checkpoint holds exactly what was simulated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fp8ptq.calibrate.observers import Grid
from fp8ptq.ops import intq
from fp8ptq.ops.fp8 import FP8_MAX, choose_fp8_scale, fake_quant_fp8, fake_quant_fp8_dynamic, pack_fp8_rows
from fp8ptq.ops.gptq import WeightGrid, fp8_grid, gptq, int_grid
from fp8ptq.ops.granularity import CHANNEL, TENSOR, TOKEN, Granularity, group
from fp8ptq.ops.intq import check_group_size
from fp8ptq.recipe import Calibration, QuantArgs

FP8_GRID = Grid("fp8", FP8_MAX, lambda x, s: fake_quant_fp8(x, s, TENSOR))
INT8_GRID = Grid("int8", 127.0, lambda x, s: intq.fake_quant_int(x, s, None, TENSOR, 8))
_CHUNK_ROWS = 8192  # bounds the fp32 temporaries of fake-quant on large calibration batches


@dataclass(frozen=True)
class LinearScheme:
    """How one Linear is quantized (one compressed-tensors config group)."""

    weights: QuantArgs
    input_activations: QuantArgs | None


def granularity(args) -> Granularity:
    """Recipe or compressed-tensors args -> Granularity."""
    strategy = getattr(args.strategy, "value", args.strategy)
    if strategy == "group":
        return group(args.group_size)
    return {"tensor": TENSOR, "channel": CHANNEL, "token": TOKEN}[strategy]


def act_grid(args) -> Grid:
    kind = getattr(args.type, "value", args.type)
    return FP8_GRID if kind == "float" else INT8_GRID


def export_format(weights: QuantArgs, acts: QuantArgs | None) -> str:
    """compressed-tensors format of a Linear: FP8 -> float-quantized, INT W8A8 -> int-quantized,
    INT weight-only (W4A16) -> pack-quantized (int4 codes packed 8 per int32)."""
    if weights.type == "float":
        return "float-quantized"
    return "int-quantized" if acts is not None else "pack-quantized"


def chunked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply a row-wise fn to x [..., d] in row chunks (same result, smaller temporaries)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= _CHUNK_ROWS:
        return fn(x)
    out = torch.empty_like(rows)
    for i in range(0, rows.shape[0], _CHUNK_ROWS):
        out[i : i + _CHUNK_ROWS] = fn(rows[i : i + _CHUNK_ROWS])
    return out.reshape(x.shape)


def input_quantizer(args, scale: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the engine does to a Linear input: static per-tensor (stored scale) or dynamic per token."""
    kind = getattr(args.type, "value", args.type)
    if args.dynamic:
        g = granularity(args)
        if kind == "float":
            return lambda x: chunked(lambda r: fake_quant_fp8_dynamic(r, g), x)
        return lambda x: chunked(lambda r: intq.fake_quant_int_dynamic(r, g, args.num_bits), x)
    assert scale is not None
    grid = act_grid(args)
    scale = scale.float().reshape(1)
    return lambda x: chunked(lambda r: grid.fake_quant(r, scale.to(r.device)), x)


@dataclass
class QuantizedWeight:
    fake: torch.Tensor  # fp32 [out, in], exactly on the grid described by params
    params: dict[str, torch.Tensor]  # weight_scale [, weight_zero_point] as compressed-tensors stores them
    report: dict


def weight_grid(args: QuantArgs, cal: Calibration) -> WeightGrid:
    """The GPTQ / RTN grid of a weight scheme. Weight-only integer scales are rounded to bf16, the dtype
    vLLM's W4A16 kernels load them in, so the stored scales are exactly the ones the engine uses."""
    g = granularity(args)
    if args.type == "float":
        return fp8_grid(g)
    scale_dtype = torch.bfloat16 if args.num_bits < 8 else None
    bits = args.num_bits if cal.weight_code_bits is None or args.num_bits < 8 else cal.weight_code_bits
    return int_grid(bits, args.symmetric, g, mse=cal.weight_observer == "mse", scale_dtype=scale_dtype)


def _rtn(w: torch.Tensor, args: QuantArgs, grid: WeightGrid) -> tuple[torch.Tensor, dict]:
    g = granularity(args)
    if grid.group_size is None:
        scale, zp = grid.choose(w)
        return grid.fake_quant(w, (scale, zp)), _params(scale, zp)
    n = grid.group_size
    groups = w.reshape(w.shape[0], -1, n).transpose(0, 1).reshape(-1, n)  # [(in/n)*out, n]: rows per group
    scale, zp = grid.choose(groups)
    q = grid.fake_quant(groups, (scale, zp))
    unflat = lambda t: t.reshape(-1, w.shape[0], t.shape[-1]).transpose(0, 1)  # noqa: E731
    q = unflat(q).reshape(w.shape)
    scale = unflat(scale).reshape(w.shape[0], -1)
    zp = None if zp is None else unflat(zp).reshape(w.shape[0], -1)
    assert g.kind == "group"
    return q, _params(scale, zp)


def fake_quant_weight(w: torch.Tensor, args: QuantArgs, cal: Calibration) -> torch.Tensor:
    """Round-to-nearest fake quantization of one weight [out, in] with the scheme's own grid."""
    return _rtn(w.float(), args, weight_grid(args, cal))[0]


def _params(scale: torch.Tensor, zp: torch.Tensor | None) -> dict:
    return {"weight_scale": scale} if zp is None else {"weight_scale": scale, "weight_zero_point": zp}


def quantize_group(weights: dict[str, torch.Tensor], args: QuantArgs, cal: Calibration,
                   H: torch.Tensor | None) -> dict[str, QuantizedWeight]:
    """Quantize one fused group's weights (names -> [out, in]), RTN or GPTQ (needs H, the sum of 2 x^T x
    over the group's inputs).

    The group's rows are stacked and solved as one matrix: they share the input (one Hessian), and a
    per-tensor scale of the stack is the scale the shards must share (vLLM runs them as one GEMM and
    would otherwise requantize them to the max scale, a second rounding).
    """
    names = list(weights)
    rows = [weights[n].shape[0] for n in names]
    w = torch.cat([weights[n].float() for n in names])
    g = granularity(args)
    if g.kind == "group":
        check_group_size(w.shape[1], g.group_size)
    grid = weight_grid(args, cal)
    if cal.weight_method == "gptq":
        assert H is not None, "GPTQ needs the input Hessian"
        r = gptq(w, H, grid, block_size=cal.gptq_block_size, damp=cal.gptq_damp, act_order=cal.gptq_act_order)
        q, params = r.weight, _params(r.scale, r.zero_point)
    else:
        q, params = _rtn(w, args, grid)
    out = {}
    for name, q_i, w_i, lo in zip(names, q.split(rows), w.split(rows), [sum(rows[:i]) for i in range(len(rows))]):
        p_i = {k: (v if g == TENSOR else v[lo : lo + w_i.shape[0]]).clone() for k, v in params.items()}
        report = {"weight_rel_err": float((q_i - w_i).norm() / w_i.norm().clamp_min(1e-12))}
        if H is not None:
            d = q_i - w_i  # relative output error on the calibration inputs: tr(D H D^T) / tr(W H W^T)
            report["output_rel_err"] = float(((d @ H) * d).sum().clamp_min(0).sqrt()
                                             / ((w_i @ H) * w_i).sum().clamp_min(1e-12).sqrt())
        out[name] = QuantizedWeight(q_i.contiguous(), p_i, report)
    return out


def packs_directly(args: QuantArgs, cal: Calibration) -> bool:
    """Whether RTN of this weight scheme can skip the fp32 fake-quant round trip: FP8 weights with
    per-channel or per-tensor min-max scales go straight from source tensor to FP8 codes."""
    return args.type == "float" and args.strategy in ("channel", "tensor") and cal.weight_method == "rtn"


def pack_group_fp8(weights: dict[str, torch.Tensor], args: QuantArgs) -> dict[str, tuple[dict[str, torch.Tensor], dict]]:
    """The compressed-tensors tensors (weight codes, weight_scale) and report of each weight of one fused
    group, FP8 RTN, bit-identical to compress_linear(quantize_group(...)) but in one streaming pass per
    weight (the data-free conversion's speed). Per-tensor scales are shared by the group's shards."""
    shared = None
    if granularity(args) == TENSOR:
        shared = torch.stack([choose_fp8_scale(w, TENSOR) for w in weights.values()]).amax().reshape(1)
    out = {}
    for name, w in weights.items():
        codes, scale, err, norm = pack_fp8_rows(w, shared)
        report = {"weight_rel_err": err**0.5 / max(norm**0.5, 1e-12)}
        out[name] = ({"weight": codes, "weight_scale": scale.clone()}, report)
    return out
