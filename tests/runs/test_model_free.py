"""The model-free path (issue 33, item 4): any safetensors checkpoint quantized by tensor names, without
building the model. Its tensors and config are byte for byte what `fp8ptq quantize` writes for the same
data-free recipe on the families both handle; a model_type transformers does not know still converts;
what no rule can place is refused by name; --dry-run writes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_cli

pytestmark = pytest.mark.tiny


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize(
    "family, recipe", [("llama", "fp8-dynamic"), ("qwen3_moe", "fp8-dynamic"), ("phi3", "fp8-block")]
)
def test_model_free_writes_what_quantize_writes(family, recipe, tiny_model, tmp_path):
    model = tiny_model(family)
    extra = ["--block-size", "16"] if recipe == "fp8-block" else []
    quick = ["--eval-samples", "0", "--no-recipe-gates"]
    rc, output = run_cli("quantize", model, "-r", recipe, "-o", tmp_path / "q", *quick, *extra)
    assert rc == 0, output
    if recipe == "fp8-block":  # the model-free path takes the recipe as written: the same 16-blocks
        import yaml

        from fp8ptq.recipe import load_recipe

        r = load_recipe(recipe).model_dump(mode="json")
        r["scheme"]["weights"]["block_structure"] = [16, 16]
        r["scheme"]["input_activations"]["group_size"] = 16
        (tmp_path / "r.yaml").write_text(yaml.safe_dump(r))
        recipe = str(tmp_path / "r.yaml")
    rc, output = run_cli("model-free", model, "-r", recipe, "-o", tmp_path / "mf")
    assert rc == 0, output
    q, mf = _tensors(tmp_path / "q"), _tensors(tmp_path / "mf")
    assert set(q) == set(mf)
    different = [k for k in q if q[k].dtype != mf[k].dtype or not torch.equal(q[k], mf[k])]
    assert not different, different
    qc = [json.loads((tmp_path / d / "config.json").read_text())["quantization_config"] for d in ("q", "mf")]
    assert qc[0]["config_groups"] == qc[1]["config_groups"]
    # every Linear quantize left in float (the LM head, routers) is in model-free's ignore, by exact name
    floats = (torch.bfloat16, torch.float16, torch.float32)
    kept = {k[:-7] for k, t in q.items() if k.endswith(".weight") and t.dim() == 2 and t.dtype in floats}
    kept = {k for k in kept if "embed" not in k}
    assert kept <= set(qc[1]["ignore"]), (kept, qc[1]["ignore"])
    assert family != "qwen3_moe" or "model.layers.0.mlp.gate" in kept


def test_a_model_type_transformers_does_not_know_converts(tiny_dir, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["model_type"] = "fp8ptq_renamed_llama"  # a known architecture under a type nobody registered
    (model / "config.json").write_text(json.dumps(cfg))
    rc, output = run_cli("quantize", model, "-o", tmp_path / "q", "--eval-samples", "0")
    assert rc == 2, output  # the family path cannot build it ...
    rc, output = run_cli("model-free", model, "-o", tmp_path / "mf", "--dry-run")
    assert rc == 0 and not (tmp_path / "mf").exists(), output  # ... the dry run lists, and writes nothing
    assert "quantize: a Linear weight" in output and "keep: embedding" in output
    rc, output = run_cli("model-free", model, "-o", tmp_path / "mf")
    assert rc == 0, output
    written = json.loads((tmp_path / "mf" / "config.json").read_text())
    assert written["model_type"] == "fp8ptq_renamed_llama" and written["architectures"] == cfg["architectures"]
    qc = QuantizationConfig.model_validate(written["quantization_config"])  # parses under compressed-tensors
    assert qc.format == "float-quantized"
    t = _tensors(tmp_path / "mf")
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert t["model.embed_tokens.weight"].dtype == _tensors(model)["model.embed_tokens.weight"].dtype
    assert (tmp_path / "mf" / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()


def test_what_no_rule_places_is_refused_by_name(tiny_model, tiny_dir, tmp_path):
    rc, output = run_cli("model-free", tiny_model("gpt_oss"), "-o", tmp_path / "o")  # fused 3-D experts
    assert rc == 2 and "mlp.experts." in output and "3-D parameter" in output, output
    rc, output = run_cli("model-free", tiny_dir, "-r", "fp8-kv8", "-o", tmp_path / "o")  # needs calibration data
    assert rc == 2 and "needs calibration data" in output, output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("recipe", ["fp8-dynamic", "fp8-block"])
def test_an_empty_weight_is_refused_by_name(recipe, tiny_dir, tmp_path):
    from safetensors.torch import save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(0, 128)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    rc, output = run_cli("model-free", model, "-r", recipe, "-o", tmp_path / "o")
    assert rc == 2 and "down_proj.weight' has shape [0, 128]" in output, output
    assert not (tmp_path / "o").exists()


def test_a_multimodal_checkpoint_keeps_its_towers(tmp_path, tokenizer_dir):
    """Gemma 3 >= 4B is Gemma3ForConditionalGeneration: the language model is quantized, the vision tower
    and projector (one of them a bare 2-D parameter) keep their bytes and are ignored by pattern, and
    transformers loads the result as the same multimodal model."""
    from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    text |= dict(num_key_value_heads=2, head_dim=16, vocab_size=1024, sliding_window=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = Gemma3Config(
        text_config=text, vision_config=vision | dict(image_size=28, patch_size=14), mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    model = tmp_path / "gemma3"
    Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(model)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, model / f.name)
    rc, output = run_cli("model-free", model, "-o", tmp_path / "mf")
    assert rc == 0, output
    src, out = _tensors(model), _tensors(tmp_path / "mf")
    towers = [k for k in src if "vision_tower" in k or "multi_modal_projector" in k]
    assert towers and all(torch.equal(src[k], out[k]) and src[k].dtype == out[k].dtype for k in towers)
    assert any(k.endswith("mm_input_projection_weight") for k in towers)  # a 2-D parameter, not a .weight
    ignore = json.loads((tmp_path / "mf" / "config.json").read_text())["quantization_config"]["ignore"]
    assert r"re:.*vision_tower\..*" in ignore and r"re:.*multi_modal_projector\..*" in ignore
    lm = [k for k in out if k.endswith("q_proj.weight") and "language_model" in k]
    assert lm and all(out[k].dtype == torch.float8_e4m3fn for k in lm)
    loaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "mf"), dtype=torch.float32)
    assert type(loaded).__name__ == "Gemma3ForConditionalGeneration"
    logits = loaded(input_ids=torch.tensor([[2, 10, 20, 30]])).logits
    assert torch.isfinite(logits).all()


def test_mtp_layers_are_carried_for_vllms_method_mtp(tiny_model, tmp_path):
    """A DeepSeek-V3 checkpoint with a multi-token-prediction layer (models.synthetic.add_mtp_layer): layer
    `num_hidden_layers`, which transformers does not build. `quantize` used to drop it (vLLM then refuses
    method mtp: "MTP speculative decoding layer 2 weights missing from checkpoint"); it now carries every
    tensor of it bit for bit, in float, and lists the layer in `ignore`. The model-free path quantizes the
    layer's Linears but keeps `eh_proj` and the layer's head copy (vLLM builds them unquantized). inspect
    reports the layer, and its absence from the old export (declared, not held)."""
    from fp8ptq.api import InspectConfig, inspect
    from fp8ptq.models.synthetic import add_mtp_layer

    model = tmp_path / "src"
    shutil.copytree(tiny_model("deepseek_v3"), model)
    add_mtp_layer(model)
    src = _tensors(model)
    mtp = {k for k in src if k.startswith("model.layers.2.")}
    assert "model.layers.2.eh_proj.weight" in mtp and "model.layers.2.self_attn.q_a_proj.weight" in mtp
    quick = ["--eval-samples", "0", "--no-recipe-gates"]
    rc, output = run_cli("quantize", model, "-r", "fp8-dynamic", "-o", tmp_path / "q", *quick)
    assert rc == 0, output
    q = _tensors(tmp_path / "q")
    assert {k for k in q if k.startswith("model.layers.2.")} == mtp
    assert all(q[k].dtype == src[k].dtype and torch.equal(q[k], src[k]) for k in mtp)
    assert "model.layers.1.self_attn.o_proj.weight_scale" in q  # the decoder layers are quantized as before
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert r"re:model\.layers\.2\..*" in qc["ignore"], qc["ignore"]
    found = {f.code: f for f in inspect(InspectConfig(tmp_path / "q")).findings}
    assert "mtp-layers" in found and "mtp-missing" not in found and "ignore-unmatched" not in found, found
    # the export as it was: the layer's tensors gone, config.json still declaring it
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "q", old)
    index = json.loads((old / "model.safetensors.index.json").read_text())
    kept = {k: v for k, v in q.items() if not k.startswith("model.layers.2.")}
    from safetensors.torch import save_file

    for f in old.glob("*.safetensors"):
        f.unlink()
    save_file(kept, str(old / "model.safetensors"), metadata={"format": "pt"})
    index["weight_map"] = {k: "model.safetensors" for k in kept}
    (old / "model.safetensors.index.json").write_text(json.dumps(index))
    found = {f.code: f for f in inspect(InspectConfig(old)).findings}
    assert found["mtp-missing"].level == "info" and "mtp cannot run" in found["mtp-missing"].message
    rc, output = run_cli("model-free", model, "-r", "fp8-dynamic", "-o", tmp_path / "mf")
    assert rc == 0, output
    mf = _tensors(tmp_path / "mf")
    assert (
        mf["model.layers.2.eh_proj.weight"].dtype == torch.bfloat16 and "model.layers.2.eh_proj.weight_scale" not in mf
    )
    assert "model.layers.2.self_attn.o_proj.weight_scale" in mf
    assert (
        "model.layers.2.eh_proj"
        in json.loads((tmp_path / "mf" / "config.json").read_text())["quantization_config"]["ignore"]
    )


def test_a_top_level_mtp_block_is_carried_and_ignored(tiny_model, tmp_path):
    """Qwen3-Next / Qwen3.5 store their MTP block as `mtp.*` (vLLM's Qwen3NextMTP builds it under prefix
    `mtp`): a checkpoint holding such tensors exports them as stored, with `re:mtp\\..*` in ignore so that
    vLLM does not expect quantized Linears there."""
    from safetensors.torch import save_file

    model = tmp_path / "src"
    shutil.copytree(tiny_model("llama"), model)
    (shard,) = sorted(model.glob("*.safetensors"))
    tensors = load_file(str(shard))
    hidden = tensors["model.norm.weight"].shape[0]
    extra = {
        "mtp.fc.weight": torch.randn(hidden, 2 * hidden).bfloat16(),
        "mtp.norm.weight": torch.ones(hidden).bfloat16(),
    }
    save_file({**tensors, **extra}, str(shard), metadata={"format": "pt"})
    rc, output = run_cli(
        "quantize", model, "-r", "fp8-dynamic", "-o", tmp_path / "q", "--eval-samples", "0", "--no-recipe-gates"
    )
    assert rc == 0, output
    q = _tensors(tmp_path / "q")
    assert all(torch.equal(q[k], v) for k, v in extra.items())
    assert r"re:mtp\..*" in json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"]


def test_a_model_free_export_is_a_model_repository(tiny_dir, tmp_path):
    """Its README.md is a model card huggingface_hub parses: the source's licence carried, the scheme's
    tags, every decision counted, and the commands that serve it; the source's own card is replaced."""
    from huggingface_hub import ModelCard

    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "README.md").write_text("---\nlicense: apache-2.0\n---\n# The float model\n")
    rc, output = run_cli("model-free", model, "-r", "fp8-dynamic", "-o", tmp_path / "mf")
    assert rc == 0, output
    card = ModelCard.load(tmp_path / "mf" / "README.md")
    summary = json.loads((tmp_path / "mf" / "model_free.json").read_text())
    assert card.data.license == "apache-2.0" and "The float model" not in card.text
    assert {"fp8ptq", "compressed-tensors", "fp8"} <= set(card.data.tags)
    assert card.data.base_model is None  # a local folder is not a Hub id
    for why, names in summary["by_reason"].items():
        assert f"| {why} | {len(names)} |" in card.text
    assert f"vllm serve {tmp_path / 'mf'}" in card.text
    assert f"python -m sglang.launch_server --model-path {tmp_path / 'mf'}" in card.text
    rc, output = run_cli("push", tmp_path / "mf", "me/tiny-fp8", "--dry-run")  # it uploads as a repository
    assert rc == 0 and "README.md" in output and "model_free.json" in output, output
