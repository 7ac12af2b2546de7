"""GGUF's K-quants Q4_K, Q5_K and Q6_K: block layout, decoding and fp8ptq's own block search.

A row of `in` weights (a multiple of 256) is cut into super-blocks of 256 (ggml-common.h, read through
gguf-py 0.19's `dequantize_blocks`, which the tests use as the reference):
  Q4_K  144 bytes = d fp16, dmin fp16, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32,
        128 bytes of nibbles; value = d * sc * q - dmin * m, q in [0, 15]
  Q5_K  176 bytes = the same head, 32 bytes of fifth bits, 128 bytes of nibbles; q in [0, 31]
  Q6_K  210 bytes = 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16), d fp16;
        value = d * sc * (q - 32), q in [0, 63]
So Q6_K is a symmetric grid (per 16 weights, scale d * sc) and Q4_K / Q5_K asymmetric ones whose offset
(dmin * m) is not a whole number of steps.

The search (`quantize_k`) is fp8ptq's own: per sub-block, a scan of candidate steps, each refitted by
weighted least squares; the sub-block scales and mins rounded to 6 bits (8 for Q6_K) against the
super-block's d and dmin; then d and dmin refitted by least squares over the whole super-block for the
codes chosen, and the codes chosen again. `importance` weighs the squared error per input column (a
calibration's Hessian diagonal, what llama.cpp calls an importance matrix); without it, each weight
counts by rms(sub-block) + |w| so that large weights are kept closer. The same scan sets the 32-block
types llama.cpp's mixes fall back to (`quantize_block32`: Q4_0, Q5_0, Q5_1; layouts in ops/ggml.py).
"""

from __future__ import annotations

import torch

from fp8ptq.ops.ggml import BLOCK, f16_bytes, nibbles, pack_q4_0

QK_K = 256
BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
K_TYPES = tuple(BYTES)
SUB = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16}  # weights per sub-block
QMAX = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}
CHUNK_ROWS = 1024  # rows searched at a time: bounds the candidate tensors' memory


def _f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).float()


def _unpack_scale_min(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 bytes [..., 12] -> (sc, m) [..., 8] int32: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7,
    4-7 in the nibbles of bytes 8-11 with their top 2 bits in the high bits of bytes 0-3 / 4-7."""
    b = b.to(torch.int32)
    lo_s, lo_m, hi = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    sc = torch.cat([lo_s & 63, (hi & 15) | ((lo_s >> 6) << 4)], dim=-1)
    m = torch.cat([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], dim=-1)
    return sc, m


def _pack_scale_min(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Inverse of `_unpack_scale_min` (sc, m in [0, 63])."""
    sc, m = sc.to(torch.int32), m.to(torch.int32)
    b0 = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    b1 = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    b2 = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return torch.cat([b0, b1, b2], dim=-1).to(torch.uint8)


def unpack_k(kind: str, blocks: torch.Tensor) -> dict[str, torch.Tensor]:
    """[rows, nb * BYTES] uint8 -> {"q": int32 [rows, in] unsigned codes, "scale": fp32 [rows, in / SUB]
    (d * sc), "offset": fp32 [rows, in / SUB] (what is subtracted: dmin * m, or 32 * scale for Q6_K),
    and the raw parts "d", "dmin", "sc", "m"}. value = scale * q - offset, per sub-block."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, BYTES[kind])
    nb = b.shape[1]
    if kind == "Q6_K":
        ql, qh, sc = b[..., :128].to(torch.int32), b[..., 128:192].to(torch.int32), b[..., 192:208]
        d = b[..., 208:210].contiguous().view(torch.float16).float()  # [rows, nb, 1]
        halves = []
        for h in range(2):
            lo = ql[..., 64 * h : 64 * h + 64]
            hi = qh[..., 32 * h : 32 * h + 32]
            nib = torch.cat([lo & 15, lo >> 4], dim=-1)  # 128 values: low nibbles of 64 bytes, then high
            top = torch.cat([(hi >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
            halves.append(nib | (top << 4))
        q = torch.cat(halves, dim=-1)
        sc = sc.contiguous().view(torch.int8).to(torch.int32)
        scale = d * sc.float()
        return {
            "q": q.reshape(rows, -1),
            "scale": scale.reshape(rows, -1),
            "offset": (32 * scale).reshape(rows, -1),
            "d": d.reshape(rows, nb),
            "sc": sc,
        }
    d = b[..., 0:2].contiguous().view(torch.float16).float()
    dmin = b[..., 2:4].contiguous().view(torch.float16).float()
    sc, m = _unpack_scale_min(b[..., 4:16])
    qs = b[..., -128:].to(torch.int32).reshape(rows, nb, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, nb, QK_K)  # per 64: low nibbles, then high
    if kind == "Q5_K":
        qh = b[..., 16:48].to(torch.int32)  # bit j of byte l: fifth bit of sub-block j's weight l
        fifth = torch.stack([(qh >> j) & 1 for j in range(8)], dim=2).reshape(rows, nb, QK_K)
        q = q | (fifth << 4)
    return {
        "q": q.reshape(rows, -1),
        "scale": (d * sc.float()).reshape(rows, -1),
        "offset": (dmin * m.float()).reshape(rows, -1),
        "d": d.reshape(rows, nb),
        "dmin": dmin.reshape(rows, nb),
        "sc": sc,
        "m": m,
    }


def pack_k(kind: str, q: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin=None, m=None) -> torch.Tensor:
    """(codes [rows, in] unsigned, d [rows, nb], sc [rows, nb, n_sub] (and dmin, m for Q4_K / Q5_K)) ->
    [rows, nb * BYTES] uint8. d and dmin are stored as fp16."""
    rows = q.shape[0]
    q = q.to(torch.int32).reshape(rows, -1, QK_K)
    nb = q.shape[1]
    if kind == "Q6_K":
        ql, qh = [], []
        for h in range(2):
            v = q[..., 128 * h : 128 * h + 128]
            lo, top = v & 15, v >> 4
            ql.append(lo[..., :64] | (lo[..., 64:] << 4))
            qh.append(sum(top[..., 32 * g : 32 * g + 32] << (2 * g) for g in range(4)))
        scb = sc.to(torch.int8).view(torch.uint8).to(torch.int32)
        parts = [torch.cat(ql, -1), torch.cat(qh, -1), scb]
        body = torch.cat(parts, dim=-1).to(torch.uint8)
        return torch.cat([body, f16_bytes(d).reshape(rows, nb, 2)], dim=-1).reshape(rows, -1)
    v = q.reshape(rows, nb, 4, 2, 32)
    qs = ((v[:, :, :, 0] & 15) | ((v[:, :, :, 1] & 15) << 4)).reshape(rows, nb, 128)
    head = [f16_bytes(d).reshape(rows, nb, 2), f16_bytes(dmin).reshape(rows, nb, 2), _pack_scale_min(sc, m)]
    if kind == "Q5_K":
        fifth = (q.reshape(rows, nb, 8, 32) >> 4) & 1
        head.append(sum(fifth[:, :, j] << j for j in range(8)).to(torch.uint8))
    return torch.cat([*(h.to(torch.uint8) for h in head), qs.to(torch.uint8)], dim=-1).reshape(rows, -1)


def dequantize_k(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """[rows, nb * BYTES] -> fp32 [rows, in], value = scale * q - offset (gguf's dequantization)."""
    p = unpack_k(kind, blocks)
    rows, sub = p["q"].shape[0], SUB[kind]
    q = p["q"].float().reshape(rows, -1, sub)
    return (p["scale"].reshape(rows, -1, 1) * q - p["offset"].reshape(rows, -1, 1)).reshape(rows, -1)


def _lsq(q, x, w, offset: bool):
    """Weighted least squares x ~ s * q + b (b <= 0; b = 0 when not `offset`) per sub-block (last dim)."""
    sw, sq, sx = w.sum(-1), (w * q).sum(-1), (w * x).sum(-1)
    sqq, sqx = (w * q * q).sum(-1), (w * q * x).sum(-1)
    if offset:
        det = sw * sqq - sq * sq
        ok = det > 0
        s = torch.where(ok, (sw * sqx - sq * sx) / det.clamp_min(1e-30), 0.0)
        b = torch.where(ok, (sqq * sx - sq * sqx) / det.clamp_min(1e-30), 0.0)
        pos = b > 0  # the format's offset only lowers the grid: refit with b = 0
        s0 = sqx / sqq.clamp_min(1e-30)
        return torch.where(pos, s0, s), torch.where(pos, 0.0, b)
    return sqx / sqq.clamp_min(1e-30), torch.zeros_like(sx)


def search_scales(x: torch.Tensor, w: torch.Tensor, qmax: int, symmetric: bool, steps: int = 21):
    """Per sub-block (rows of x): (scale, offset b) minimising sum w (scale * q + b - x)^2 over a scan of
    candidate steps. Symmetric: q in [-(qmax + 1) / 2, (qmax - 1) / 2], b = 0; else q in [0, qmax], b <= 0."""
    if symmetric:
        lo_q, hi_q = -(qmax + 1) // 2, (qmax - 1) // 2
        amax = x.abs().amax(-1, keepdim=True)
        top = torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))  # the signed extreme takes code lo_q
        base = torch.where(amax > 0, top, torch.ones_like(top))
        cands = [(lo_q + 0.1 * (i - steps // 2)) / base for i in range(steps)]
        best_s = torch.zeros_like(amax[..., 0])
        best_e = torch.full_like(best_s, float("inf"))
        for inv in cands:  # inv = codes per unit, the extreme near code lo_q
            q = torch.clamp(torch.round(x * inv), lo_q, hi_q)
            s, _ = _lsq(q, x, w, offset=False)
            e = (w * (s.unsqueeze(-1) * q - x) ** 2).sum(-1)
            better = e < best_e
            best_s, best_e = torch.where(better, s, best_s), torch.where(better, e, best_e)
        return best_s, torch.zeros_like(best_s)
    lo = x.amin(-1).clamp_max(0.0)
    span = (x.amax(-1) - lo).clamp_min(1e-30)
    best_s, best_b = span / qmax, lo
    best_e = _err(x, w, best_s, best_b, 0, qmax)
    for i in range(steps):
        inv = (qmax + 0.1 * (i - steps // 2)) / span
        q = torch.clamp(torch.round((x - lo.unsqueeze(-1)) * inv.unsqueeze(-1)), 0, qmax)
        s, b = _lsq(q, x, w, offset=True)
        e = _err(x, w, s, b, 0, qmax)
        better = (e < best_e) & (s > 0)
        best_s, best_b, best_e = (torch.where(better, a, c) for a, c in ((s, best_s), (b, best_b), (e, best_e)))
    return best_s, best_b


def grid_codes(x, s, b, lo_q: int, hi_q: int):
    """The nearest codes of x on the grid s * q + b (s = 0: code 0 ... or lo_q when 0 is outside)."""
    safe = torch.where(s == 0, torch.ones_like(s), s).unsqueeze(-1)
    q = torch.round((x - b.unsqueeze(-1)) / safe)
    return torch.where((s == 0).unsqueeze(-1), torch.zeros_like(q).clamp(lo_q, hi_q), q.clamp(lo_q, hi_q))


def _err(x, w, s, b, lo_q: int, hi_q: int):
    """sum w (s * q + b - x)^2 over the last dim, q the nearest codes."""
    q = grid_codes(x, s, b, lo_q, hi_q)
    return (w * (s.unsqueeze(-1) * q + b.unsqueeze(-1) - x) ** 2).sum(-1)


def error_weights(x: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """Per-weight error weights [..., sub]: rms(sub-block) + |w|, times the column importance if given."""
    w = x.pow(2).mean(-1, keepdim=True).sqrt() + x.abs()
    if importance is not None:
        w = w * importance.float().reshape(1, *x.shape[1:]).clamp_min(0)
    return w


def _search_super(kind: str, x: torch.Tensor, w: torch.Tensor):
    """x, w [r, nb, n_sub, sub] -> the packed block parts (q unsigned, d, sc, dmin, m), d/dmin fp16-exact."""
    qmax = QMAX[kind]
    if kind == "Q6_K":
        s, _ = search_scales(x, w, qmax, symmetric=True)  # [r, nb, n_sub], signed
        top = torch.gather(s, -1, s.abs().argmax(-1, keepdim=True))  # the signed extreme takes sc = -128
        d = _f16(-top / 128)
        safe = torch.where(d == 0, torch.ones_like(d), d)
        sc = torch.where(d == 0, 0.0, torch.round(s / safe).clamp(-128, 127))
        zero = torch.zeros_like(sc)
        for _ in range(2):  # codes for these scales, then d refitted over the super-block for those codes
            q = grid_codes(x, d * sc, zero, -32, 31)
            u = sc.unsqueeze(-1) * q
            num, den = (w * u * x).sum((-1, -2)), (w * u * u).sum((-1, -2))
            d_new = _f16(torch.where(den > 0, num / den.clamp_min(1e-30), 0.0)).unsqueeze(-1)
            keep = _sum_err(x, w, d_new * sc, zero, -32, 31) <= _sum_err(x, w, d * sc, zero, -32, 31)
            d = torch.where(keep, d_new, d)
        q = grid_codes(x, d * sc, zero, -32, 31)
        return q + 32, d[..., 0], sc, None, None
    s, b = search_scales(x, w, qmax, symmetric=False)  # s >= 0, b <= 0
    mn = -b
    d = _f16(s.amax(-1, keepdim=True) / 63)
    dmin = _f16(mn.amax(-1, keepdim=True) / 63)
    sc = torch.round(s / torch.where(d == 0, torch.ones_like(d), d)).clamp(0, 63)
    m = torch.round(mn / torch.where(dmin == 0, torch.ones_like(dmin), dmin)).clamp(0, 63)
    for _ in range(2):  # codes for these scales, then (d, dmin) refitted over the super-block
        q = grid_codes(x, d * sc, -dmin * m, 0, qmax)
        u, v = (sc.unsqueeze(-1) * q), m.unsqueeze(-1).expand_as(q)  # x ~ d * u - dmin * v
        suu, svv, suv = (w * u * u).sum((-1, -2)), (w * v * v).sum((-1, -2)), (w * u * v).sum((-1, -2))
        sux, svx = (w * u * x).sum((-1, -2)), (w * v * x).sum((-1, -2))
        det = suu * svv - suv * suv
        ok = det > 1e-30
        d_new = torch.where(ok, (svv * sux - suv * svx) / det.clamp_min(1e-30), d[..., 0])
        dmin_new = torch.where(ok, (suv * sux - suu * svx) / det.clamp_min(1e-30), dmin[..., 0])
        d_new, dmin_new = _f16(d_new.clamp_min(0)).unsqueeze(-1), _f16(dmin_new.clamp_min(0)).unsqueeze(-1)
        keep = _sum_err(x, w, d_new * sc, -dmin_new * m, 0, qmax) <= _sum_err(x, w, d * sc, -dmin * m, 0, qmax)
        d, dmin = torch.where(keep, d_new, d), torch.where(keep, dmin_new, dmin)
    q = grid_codes(x, d * sc, -dmin * m, 0, qmax)
    return q, d[..., 0], sc, dmin[..., 0], m


def _sum_err(x, w, s, b, lo_q, hi_q):
    return _err(x, w, s, b, lo_q, hi_q).sum(-1, keepdim=True)


def quantize_k(kind: str, weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """weight [rows, in] (in a multiple of 256) -> [rows, in / 256 * BYTES[kind]] uint8 blocks.
    `importance` [in]: non-negative weight of each input column's squared error (None: all equal)."""
    rows, cols = weight.shape
    if cols % QK_K:
        raise ValueError(f"{kind} needs rows of a multiple of {QK_K} weights, not {cols}")
    sub = SUB[kind]
    out = []
    for start in range(0, rows, CHUNK_ROWS):
        x = weight[start : start + CHUNK_ROWS].float().reshape(-1, cols // QK_K, QK_K // sub, sub)
        q, d, sc, dmin, m = _search_super(kind, x, error_weights(x, importance))
        r = x.shape[0]
        out.append(
            pack_k(kind, q.reshape(r, -1), d, sc.to(torch.int32), dmin, None if m is None else m.to(torch.int32))
        )
    return torch.cat(out)


def int8_grid(kind: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A K-quant tensor onto compressed-tensors' INT8 symmetric group-32 grid (what vLLM's W8A16 kernels take):
    (codes int8 [rows, in], scale fp32 [rows, in / 32]). Each 32-group's scale is its largest magnitude / 127
    and the codes its values rounded: an error of at most half of that step, about 1/8 of a Q5_K / Q6_K step
    (their codes span 31 / 64 steps of up to two sub-block scales)."""
    v = dequantize_k(kind, blocks)
    rows = v.shape[0]
    g = v.reshape(rows, -1, 32)
    scale = g.abs().amax(-1) / 127
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).unsqueeze(-1)
    codes = torch.round(g / safe).clamp(-127, 127)
    return codes.to(torch.int8).reshape(rows, -1), scale


def _pack_5(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [rows, nb, 32] in [0, 31] -> (qh [rows, nb, 4]: the fifth bits of weights 0..31 as one
    little-endian uint32, qs [rows, nb, 16]: the low nibbles, `ops.ggml.nibbles`)."""
    q = q.to(torch.int64)
    qh = (((q >> 4) & 1) << torch.arange(BLOCK)).sum(-1, keepdim=True)
    qh = torch.cat([(qh >> (8 * i)) & 255 for i in range(4)], dim=-1)
    return qh.to(torch.uint8), nibbles(q & 15)


def quantize_block32(kind: str, weight: torch.Tensor, importance: torch.Tensor | None = None) -> torch.Tensor:
    """weight [rows, in] (in a multiple of 32) -> Q4_0 / Q5_0 / Q5_1 blocks [rows, in / 32 * size] (the
    32-block types llama.cpp's mixes use: Q4_0, and the fallbacks of Q4_K / Q5_K), each block's scale (and
    offset) searched by weighted least squares (`search_scales`, the K-quants' scan) rather than set from its extreme as
    llama.cpp's reference quantizer does; d and m stored as fp16, codes chosen for the stored values."""
    rows, cols = weight.shape
    x = weight.float().reshape(rows, cols // BLOCK, BLOCK)
    symmetric = kind in ("Q4_0", "Q5_0")
    qmax = 15 if kind == "Q4_0" else 31
    s, b = search_scales(x, error_weights(x, importance), qmax, symmetric)
    d = s.to(torch.float16).float()
    if symmetric:
        lo = -(qmax + 1) // 2
        q = grid_codes(x, d, torch.zeros_like(d), lo, qmax + lo)  # value = d * q
        if kind == "Q4_0":
            return pack_q4_0(q.reshape(rows, -1), d)
        qh, qs = _pack_5(q - lo)
        return torch.cat([f16_bytes(d), qh, qs], dim=-1).reshape(rows, -1)
    m = b.to(torch.float16).float()
    qh, qs = _pack_5(grid_codes(x, d, m, 0, qmax))  # Q5_1: value = d * q + m
    return torch.cat([f16_bytes(d), f16_bytes(m), qh, qs], dim=-1).reshape(rows, -1)
