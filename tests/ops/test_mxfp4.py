"""MXFP4 (ops/fp4.py) against compressed-tensors' own pieces: its E8M0 scale rule (`generate_mx_scales`)
and its mxfp4-pack-quantized compressor decompressing our fake-quant bit for bit (RTN, the MSE
exponent choice and GPTQ), with finite power-of-two scales for all-zero, tiny, huge and broken groups."""

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

from fp8ptq.ops.fp4 import choose_mxfp4_scale, fake_quant_mxfp4, fake_quant_mxfp4_act, mxfp4_grid
from fp8ptq.ops.gptq import gptq

from helpers import mx_round_trip, mx_rtn, vllm_venv_prints

ARGS = QuantizationArgs(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True, scale_dtype="uint8")


def _rtn(w: torch.Tensor, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    return mx_rtn(w, choose_mxfp4_scale, fake_quant_mxfp4, mse)


def _ct_round_trip(fake: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    stored = {  # two E2M1 codes per byte, E8M0 exponents, no global scale
        "weight_packed": (torch.uint8, (fake.shape[0], fake.shape[1] // 2)),
        "weight_scale": (torch.uint8, tuple(scale.shape)),
    }
    return mx_round_trip("mxfp4-pack-quantized", ARGS, fake, scale, stored)


def test_minmax_scale_is_compressed_tensors_rule():
    torch.manual_seed(0)
    amax = (torch.rand(4096) * torch.logspace(-6, 4, 4096)).to(torch.bfloat16)
    amax = torch.cat([amax, torch.tensor([1.0, 1.5, 1.75, 1.749, 6.0, 7.0, 8.0], dtype=torch.bfloat16)])
    ours = choose_mxfp4_scale(torch.stack([amax.float(), torch.zeros_like(amax).float()], dim=-1))
    ct = torch.exp2(generate_mx_scales(amax.reshape(-1, 1)).float() - 127)
    assert torch.equal(ours, ct)


@pytest.mark.parametrize("mse", [False, True])
@pytest.mark.parametrize("shape", [(64, 128), (48, 32), (8, 64)])
def test_compressor_decompresses_our_weights_exactly(shape, mse):
    torch.manual_seed(1)
    w = torch.randn(shape) * torch.logspace(-30, 3, shape[1])  # groups of very different size
    w[0, :32] = 0.0  # an all-zero group: decodes to 0
    w[1, :32] = 1e30  # a huge group
    fake, scale = _rtn(w, mse)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))  # powers of two
    assert torch.equal(fake[0, :32], torch.zeros(32))
    assert torch.equal(_ct_round_trip(fake, scale), fake)


def test_mse_exponent_never_worse_than_the_rule():
    torch.manual_seed(2)
    w = torch.randn(256, 32) * torch.rand(256, 1) * 10
    err = lambda mse: (_rtn(w, mse)[0] - w).square().sum(-1)  # noqa: E731
    assert (err(True) <= err(False)).all() and err(True).sum() < 0.995 * err(False).sum()  # measured: 1.2% less


def test_non_finite_and_zero_groups_get_finite_scales():
    w = torch.randn(4, 32)
    w[0] = 0.0
    w[1, 3] = float("nan")
    w[2, 5] = float("inf")
    for mse in (False, True):
        s = choose_mxfp4_scale(w, mse)
        assert torch.isfinite(s).all() and (s > 0).all(), s
        assert torch.isfinite(fake_quant_mxfp4(w[2:3], s[2:3])).all()  # inf saturates to 6 * scale
        assert torch.isnan(fake_quant_mxfp4(w[1:2], s[1:2])).any()  # a NaN stays visible (refused at load)


@pytest.mark.parametrize("mse", [False, True])
def test_gptq_on_the_mx_grid_exports_exactly_and_helps(mse):
    torch.manual_seed(3)
    W = torch.randn(64, 128)
    X = torch.randn(1024, 128) @ (torch.eye(128) + 0.3 * torch.randn(128, 128))  # correlated inputs
    H = 2 * X.T @ X
    r = gptq(W, H, mxfp4_grid(mse))
    assert r.scale.shape == (64, 4)
    assert torch.equal(_ct_round_trip(r.weight, r.scale), r.weight)
    rtn, _ = _rtn(W, mse)
    err = lambda q: float((((q - W) @ H) * (q - W)).sum())  # noqa: E731
    assert err(r.weight) < 0.9 * err(rtn)


def test_dynamic_activations_are_per_group_of_32():
    torch.manual_seed(5)
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    x[0, 0, 32:] *= 1000  # one loud group does not coarsen its neighbour
    q = fake_quant_mxfp4_act(x)
    assert q.shape == x.shape and q.dtype == x.dtype
    assert torch.equal(q[0, 0, :32], fake_quant_mxfp4_act(x[0, 0, :32].reshape(1, 32)).reshape(32))
    assert 0.05 < ((q - x).float().norm() / x.float().norm()).item() < 0.2  # E2M1: 1 mantissa bit


# vLLM 0.32's portable MXFP4 activation quantizer is a Triton kernel (mxfp4_utils.downcast_to_mxfp); its
# own functions, read from the installed file, run in Triton's interpreter on CPU (vLLM's import-time
# placeholder for Triton on a CPU build is bypassed by executing them with the real triton module).
_VLLM_CHECK = """
import ast, torch, triton, triton.language as tl
import vllm.model_executor.layers.quantization.utils.mxfp4_utils as m
from fp8ptq.ops.fp4 import fake_quant_mxfp4_act
tree = ast.parse(open(m.__file__).read())
wanted = ("permute_shape", "_compute_quant_and_scale", "_downcast_to_mxfp", "downcast_to_mxfp")
body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
assert len(body) == len(wanted), [n.name for n in body]
ns = {"triton": triton, "tl": tl, "torch": torch}
exec(compile(ast.Module(body=body, type_ignores=[]), m.__file__, "exec"), ns)
torch.manual_seed(0)
x = torch.randn(64, 256) * torch.logspace(-8, 8, 256)
x[3, :32] = 0  # an all-zero group
edges = torch.tensor([1.0, 1.5, 1.75, 1.7499, 7.0, 6.9, 0.25, 0.75, 2.5, 5.0, 3.5, 0.125])
x[4:8, :12] = edges * torch.tensor([[1.0], [-1.0], [2.0**-20], [2.0**20]])  # amax mantissas and E2M1 ties
x = x.to(torch.bfloat16)
q, s, _ = ns["downcast_to_mxfp"](x, axis=-1)
lut = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
codes = torch.stack([q & 15, q >> 4], -1).reshape(64, 256).long()
deq = (lut[codes].view(64, 8, 32) * torch.exp2(s.float() - 127).unsqueeze(-1)).view(64, 256)
print(torch.equal(deq, fake_quant_mxfp4_act(x).float()))
"""


@pytest.mark.slow  # needs .venv-vllm
def test_dynamic_activations_are_vllms_own_quantizer():
    """vLLM's MXFP4 activation quantizer (the portable one its W4A4 path falls back to), run from its
    installed source in its own venv, gives the same values as fp8ptq's simulation, bit for bit."""
    assert vllm_venv_prints(_VLLM_CHECK, TRITON_INTERPRET="1") == "True"
