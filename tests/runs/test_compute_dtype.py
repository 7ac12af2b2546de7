"""`quantize --compute-dtype`: the arithmetic of the calibration passes (ops/precision.py)."""

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import Fp8ptqError
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.ops.hessian import hessian_partial
from fp8ptq.ops.precision import pass_precision, strict_fp32
from fp8ptq.runs.context import resolve_compute_dtype

pytestmark = pytest.mark.tiny
Q_PROJ = "model.layers.1.self_attn.q_proj"


def test_auto_is_tf32_on_cuda_and_fp32_on_a_cpu():
    assert resolve_compute_dtype("auto", "cpu") == "fp32"
    assert resolve_compute_dtype("auto", "cuda:1") == "tf32"
    assert resolve_compute_dtype("bf16", "cpu") == "bf16"
    with pytest.raises(Fp8ptqError, match="TF32 is a CUDA matmul mode") as e:
        resolve_compute_dtype("tf32", "cpu")
    assert "--compute-dtype fp32 or bf16" in e.value.fix
    with pytest.raises(Fp8ptqError, match="unknown --compute-dtype 'fp16'"):
        resolve_compute_dtype("fp16", "cuda")


def test_a_tf32_pass_keeps_the_hessian_in_ieee_fp32():
    """The flag a TF32 pass sets, and the IEEE fp32 the Hessian's matmul switches back to inside it (the
    flag is process state, so this holds on a CPU-only torch too); a CPU pass touches nothing."""
    m = torch.backends.cuda.matmul
    before = m.fp32_precision
    seen = {}
    orig = torch.mm

    def spy(*a, **k):
        seen.setdefault("mm", m.fp32_precision)
        return orig(*a, **k)

    x = torch.randn(2, 8, 600)
    with pass_precision("tf32", torch.device("cpu")):
        assert m.fp32_precision == before
    with pass_precision("tf32", torch.device("cuda")):
        assert m.fp32_precision == "tf32"
        with strict_fp32():
            assert m.fp32_precision == "ieee"
        torch.mm = spy
        try:
            H = hessian_partial(x)  # 600 wide: the blocked torch.mm path
        finally:
            torch.mm = orig
        assert m.fp32_precision == "tf32"
    assert m.fp32_precision == before
    assert seen["mm"] == "ieee"
    assert torch.equal(H, hessian_partial(x))  # the same bits as outside any pass


def test_bf16_passes_on_a_cpu(tiny_dir, tmp_path):
    """bf16 passes quantize the same model into a loadable export whose static input scales are those of
    bf16 activations: close to the fp32 run's, not equal; the manifest says which arithmetic ran."""
    runs = {}
    for cd in ("auto", "bf16"):
        out = tmp_path / cd
        cfg = QuantizeConfig(
            model=str(tiny_dir), recipe="fp8-kv8", output=out, num_samples=4, seq_len=48, eval_samples=0,
            device="cpu", compute_dtype=cd,
        )  # fmt: skip
        runs[cd] = (quantize(cfg), open_hf_dir(out))
    (m32, q32), (m16, q16) = runs["auto"], runs["bf16"]
    assert (m32.run.compute_dtype, m16.run.compute_dtype) == ("fp32", "bf16")
    s32, s16 = (q.tensor(f"{Q_PROJ}.input_scale").float() for q in (q32, q16))
    assert not torch.equal(s32, s16)
    assert torch.allclose(s32, s16, rtol=0.02), (s32, s16)
    for q in (q32, q16):
        assert q.tensor(f"{Q_PROJ}.weight").dtype == torch.float8_e4m3fn


def test_bf16_passes_on_the_generic_path(tiny_model, tmp_path):
    """The generic path runs whole layers with every argument the stack captured (rotary cos/sin, masks):
    bf16 passes cast them with the layer, in the passes and in the trace (they failed before: an fp32
    query against bf16 values). A Qwen3-Next layer stack (gated DeltaNet + attention) and Gemma 3's
    multimodal one, each close to its fp32 run."""
    sizes = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    hybrid = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    for model_type, extra in (("qwen3_next", dict(hybrid, layer_types=("linear_attention", "full_attention"))),
                              ("gemma3", {})):  # fmt: skip
        model = tiny_model(model_type, max_position_embeddings=512, **sizes, **extra)
        scales = []
        for cd in ("auto", "bf16"):
            cfg = QuantizeConfig(
                model=str(model), recipe="fp8-kv8", output=tmp_path / f"{model_type}-{cd}", num_samples=4,
                seq_len=32, eval_samples=0, device="cpu", compute_dtype=cd, weights="rtn",
            )  # fmt: skip
            assert quantize(cfg).run.compute_dtype == ("fp32" if cd == "auto" else "bf16")
            q = open_hf_dir(tmp_path / f"{model_type}-{cd}")
            scales.append({n: q.tensor(n).float() for n in q.weight_map if n.endswith("input_scale")})
        ratio = {n: float(scales[1][n] / scales[0][n]) for n in scales[0]}
        print(model_type, {n: round(r, 3) for n, r in ratio.items() if abs(r - 1) > 0.03})
        assert any(r != 1 for r in ratio.values()) and all(abs(r - 1) < 0.05 for r in ratio.values()), ratio
