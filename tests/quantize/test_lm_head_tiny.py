"""Tier 2: a quantized LM head (`--quantize-lm-head`, recipe `scheme.lm_head`) on tiny random models:
its own config group targeted by name, `lm_head` out of `ignore`, a tied head written untied (the
embedding kept as stored), compressed-tensors' compressor decompressing it to the simulated weights, and
the evaluator running the head on its quantized inputs. Refusals: static head inputs."""

from dataclasses import replace

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.errors import RecipeError
from fp8ptq.eval.quality import compare, load_simulated
from fp8ptq.export.compressed_tensors import ct_scheme, decompress_linear
from fp8ptq.manifest import Manifest
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.quantization.schemes import LinearScheme
from fp8ptq.recipe import Head, load_recipe, parse_recipe
from fp8ptq.runs.overrides import head_from

from helpers import parse_config_under, read_config, read_tensors

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def export(tmp_path_factory, tiny_model):
    """export(recipe, tied, head) -> (source, export dir): built once per argument set, and only when asked."""
    done = {}

    def make(recipe: str, tied: bool, head: bool = True):
        key = (recipe, tied, head)
        if key not in done:
            src = tiny_model("llama", tie_word_embeddings=tied)
            out = tmp_path_factory.mktemp(f"head-{recipe}-{tied}-{head}") / "q"
            cfg = QuantizeConfig(model=str(src), recipe=recipe, output=out, num_samples=4, seq_len=64, eval_samples=0)
            quantize(replace(cfg, quantize_lm_head=head))
            done[key] = (src, out)
        return done[key]

    return make


@pytest.mark.parametrize("tied", [True, False])
def test_head_group_config_and_tensors(tied, export):
    src, out = export("fp8-dynamic", tied)
    _, plain = export("fp8-dynamic", tied, head=False)
    cfg = read_config(out)
    qc = cfg["quantization_config"]
    assert "lm_head" not in qc["ignore"]
    groups = {tuple(g["targets"]): g for g in qc["config_groups"].values()}
    head = groups[("lm_head",)]  # --quantize-lm-head on an 8-bit recipe: INT8 per channel, weight-only
    assert (head["weights"]["type"], head["weights"]["strategy"]) == ("int", "channel")
    assert head["input_activations"] is None and head["format"] == "pack-quantized"
    assert cfg["tie_word_embeddings"] is False  # tied or not, the export's head is its own tensor
    assert parse_config_under(qc, "0.17.0") == "0.17.0"
    t = read_tensors(out)
    assert t["lm_head.weight_packed"].dtype == torch.int32 and t["lm_head.weight_scale"].shape == (1024, 1)
    s = t["lm_head.weight_scale"].float()
    assert torch.equal(s, s.to(torch.bfloat16).float())  # what vLLM's weight-only kernels load
    assert t["model.embed_tokens.weight"].dtype == read_tensors(src)["model.embed_tokens.weight"].dtype
    m = Manifest.load(out)
    assert m.lm_head.tied is tied and 0 < m.lm_head.weight_rel_err < 0.05
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # through compressed-tensors
    assert hf.config.tie_word_embeddings is False
    with torch.inference_mode():
        assert torch.isfinite(hf(torch.tensor([[1, 2, 3, 4]])).logits).all()
    assert m.size_bytes.output > Manifest.load(plain).size_bytes.output - (0 if tied else 1024 * 64)


def test_head_decompresses_to_what_is_simulated(export):
    src, out = export("w8a8-int8", True)
    t = read_tensors(out)
    head = Head.model_validate(head_from(load_recipe("w8a8-int8").scheme))  # what --quantize-lm-head wrote
    ls = LinearScheme(head.weights, head.input_activations)
    fmt = read_config(out)["quantization_config"]["config_groups"]
    fmt = next(g for g in fmt.values() if g["targets"] == ["lm_head"]).get("format") or "int-quantized"
    state = {k.removeprefix("lm_head."): v for k, v in t.items() if k.startswith("lm_head.")}
    w = decompress_linear(state, ct_scheme(ls, ["Linear"]), fmt)
    sim = load_simulated(open_hf_dir(out))
    assert torch.equal(sim.model.get_output_embeddings().weight.float(), w)
    assert not torch.equal(w, read_tensors(src)["model.embed_tokens.weight"].float())


def test_quantized_head_costs_a_little_quality(export):
    src, out = export("w8a8-int8", False)
    _, plain = export("w8a8-int8", False, head=False)
    from fp8ptq.data import load_samples

    ids = load_samples("builtin", open_hf_dir(src).tokenizer(), 2, 48, "evaluation")
    ref = load_simulated(open_hf_dir(src), simulate=False).model
    kl_q = compare(ref, load_simulated(open_hf_dir(out)).model, ids)["kl"]
    kl_plain = compare(ref, load_simulated(open_hf_dir(plain)).model, ids)["kl"]
    assert kl_plain < kl_q < kl_plain + 0.05, (kl_plain, kl_q)


def test_static_head_inputs_are_refused():
    base = {"name": "x", "description": "x", "calibration": {"weight_method": "rtn"}}
    w = {"num_bits": 8, "type": "float", "strategy": "channel"}
    static = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
    scheme = {"weights": w, "lm_head": {"weights": w, "input_activations": static}}
    with pytest.raises(RecipeError, match="the LM head's inputs are not calibrated"):
        parse_recipe({**base, "scheme": scheme}, "x.yaml")


def test_head_group_wins_over_the_class_target(export):
    """fp8-kv8's Linears are FP8 with static inputs, its head INT8 weight-only: the evaluator must pick the
    head's own group by its exact name (compressed-tensors' order), not the first group whose class matches."""
    _, out = export("fp8-kv8", True)
    sim = load_simulated(open_hf_dir(out))
    assert sim.numerics["quantized_linears"] == 15
    assert (sim.numerics["static_inputs"], sim.numerics["dynamic_inputs"]) == (14, 0), sim.numerics
