"""The evaluator computes what the engine computes: FP8 inputs and KV included, for any checkpoint."""

import pytest
import torch
import transformers
from packaging.version import Version

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.data import load_samples
from fp8ptq.eval.quality import compare, load_simulated
from fp8ptq.models.loader import open_hf_dir

from independent import kl_top1_ppl, load_fake_quant, load_plain

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def kv8_tiny(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("e") / "kv8"
    quantize(
        QuantizeConfig(model=str(tiny_dir), recipe="fp8-kv8", output=out, num_samples=4, seq_len=64, eval_samples=0)
    )
    return out


def test_simulation_matches_independent_fake_quant_and_exceeds_plain_load(kv8_tiny, tiny_dir):
    ids = load_samples("builtin", open_hf_dir(tiny_dir).tokenizer(), 2, 64, split="evaluation")
    ref = load_simulated(open_hf_dir(tiny_dir)).model
    sim = load_simulated(open_hf_dir(kv8_tiny))
    assert sim.numerics["static_inputs"] == 14 and sim.numerics["kv_layers"] == 2
    ours = compare(ref, sim.model, ids)
    indep = kl_top1_ppl(load_plain(tiny_dir), load_fake_quant(kv8_tiny), ids)
    assert ours["kl"] == pytest.approx(indep["kl"], rel=2e-3, abs=1e-7)
    assert ours["ppl"] == pytest.approx(indep["ppl"], rel=1e-4)
    # Dequantized weights alone (what engines without activation quantization, and older transformers
    # loads, compute) hide the activation + KV error: strictly smaller KL.
    nosim = compare(ref, load_simulated(open_hf_dir(kv8_tiny), simulate=False).model, ids)
    assert ours["kl"] > nosim["kl"] * 1.05
    # transformers >= 5.23 + compressed-tensors 0.20 fake-quantize static inputs on a plain load (older
    # versions did not). 5.23 also quantized the KV cache with the stored scales, and then computed what
    # the engine computes; 5.24 leaves k_scale / v_scale unread (no KV quantization) and reports a
    # larger KL than the engine numerics (cause not traced): only 5.23 is held to the engine's numbers.
    plain = kl_top1_ppl(load_plain(tiny_dir), load_plain(kv8_tiny), ids)
    assert plain["kl"] > nosim["kl"]
    if Version(transformers.__version__) < Version("5.24"):
        assert plain["kl"] <= ours["kl"] * 1.002


def test_unquantized_model_vs_itself_is_exact(tiny_dir):
    ids = torch.randint(0, 1000, (1, 32))
    m = load_simulated(open_hf_dir(tiny_dir)).model
    r = compare(m, m, ids)
    assert r["kl"] == pytest.approx(0.0, abs=1e-7) and r["top1"] == 1.0


def test_simulated_model_masks_cache_and_padding(tiny_dir):
    """Several new tokens after a KV cache, and left-padded batches, need the real attention mask (a
    plain causal mask would be wrong): fp8ptq's attention registers transformers' sdpa mask builder."""
    import torch
    from transformers import DynamicCache

    from fp8ptq.eval.quality import load_simulated
    from fp8ptq.models.loader import open_hf_dir

    model = load_simulated(open_hf_dir(tiny_dir)).model
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 61, 8]])
    with torch.inference_mode():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        tail = model(ids[:, 5:], past_key_values=cache, use_cache=True).logits
        torch.testing.assert_close(tail, full[:, 5:], rtol=1e-4, atol=1e-4)
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
        mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
        out = model(padded, attention_mask=mask).logits[:, 3:]
        torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-4)


def test_eval_quality_checks_gates_on_an_existing_export(kv8_tiny, tiny_dir):
    """`eval quality --gate` / `--recipe-gates`: the gates checked on the numbers measured (exit 3 on a
    failure), weight_bits read off the export's files, a metric eval cannot produce refused up front."""
    import json

    from typer.testing import CliRunner

    from fp8ptq.cli import app
    from fp8ptq.cli.common import GATE_FAILED_EXIT
    from fp8ptq.eval.bits import weight_bits

    bits = weight_bits(open_hf_dir(kv8_tiny))
    assert 8.0 < bits < 8.1  # FP8 codes + per-tensor weight and input scales of a 64-wide model
    base = ["eval", "quality", str(kv8_tiny), "--reference", str(tiny_dir), "--num-samples", "1", "--seq-len", "32"]
    base += ["--no-record", "--json"]
    r = CliRunner().invoke(app, [*base, "--gate", "weight_bits<=8.1", "--gate", "kl<=100"])
    assert r.exit_code == 0, r.output
    gates = json.loads(r.output)["gates"]
    assert [g["passed"] for g in gates] == [True, True] and abs(gates[0]["value"] - bits) < 1e-9
    r = CliRunner().invoke(app, [*base, "--gate", "weight_bits<=7.9"])
    assert r.exit_code == GATE_FAILED_EXIT and json.loads(r.output)["gates"][0]["passed"] is False
    r = CliRunner().invoke(app, [*base, "--recipe-gates"])  # fp8-kv8's own: kl, top1, weight_bits
    assert r.exit_code in (0, GATE_FAILED_EXIT)
    assert [g["metric"] for g in json.loads(r.output)["gates"]] == ["kl", "top1", "weight_bits"]
    r = CliRunner().invoke(app, [*base, "--gate", "worst_linear_rel_err<=1"])
    assert r.exit_code == 2 and "has no metric 'worst_linear_rel_err'" in r.output
    r = CliRunner().invoke(app, ["eval", "quality", str(tiny_dir), "--reference", str(tiny_dir), "--recipe-gates"])
    assert r.exit_code == 2 and "no recipe.yaml" in r.output, r.output
