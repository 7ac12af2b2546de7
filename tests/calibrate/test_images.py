"""Image+text calibration (`quantize --images`, calibrate/images.py) on a tiny random model of SmolVLM's
layout (idefics3) with its own processor: the first decoder layer's input is what transformers' forward
computes from the image and the text, each image row's layers run as the model runs them (Gemma 3: with
its own bidirectional image mask), the images reach the calibration, the towers are copied as stored, and
bad input is refused in one line before any layer is calibrated."""

import json

import pytest
import torch

from fp8ptq.models.synthetic import write_images, write_random_vlm

from helpers import QUICK, assert_one_line_error, crash_at_checkpoint, read_tensors, run_cli

pytestmark = pytest.mark.tiny
DENSE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
ARGS = ["--num-samples", "3", "--seq-len", "48", "--eval-samples", "0", "--no-recipe-gates", "--weights", "rtn"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("vlm")
    return write_random_vlm(root / "model", tokenizer_dir, layers=2, **DENSE), write_images(root / "images", 2)


def test_first_layer_input_is_the_models_own_forward(vlm):
    from transformers import AutoModelForImageTextToText

    from fp8ptq.calibrate.images import embed, image_rows
    from fp8ptq.data import BUILTIN, load_samples
    from fp8ptq.models.loader import resolve_model
    from fp8ptq.models.skeleton import build_skeleton
    from fp8ptq.quantization.numerics import register_attention

    model_dir, jsonl = vlm
    src = resolve_model(str(model_dir))
    tok = src.tokenizer()
    text = load_samples(BUILTIN, tok, 3, 48)
    rows = image_rows(str(jsonl), src, text, tok.eos_token_id)
    assert len(rows) == 2 and torch.equal(rows.merged(text)[2], text[2])  # 2 image rows, then text
    skeleton = build_skeleton(src.config, attn_implementation=register_attention())
    text = src.arch.layer_inputs(skeleton, 48, torch.device("cpu"))
    found = embed(skeleton, src, src.arch, rows, text, local=range(3), device=torch.device("cpu"))
    got = {i: x for i, x, own in found if own is None}  # SmolVLM's layers take the text rows' arguments
    assert sorted(got) == [0, 1]
    assert all(p.is_meta for p in skeleton.model.vision_model.parameters())  # the tower is released after
    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    image = src.config.image_token_id
    for i in (0, 1):
        ids = rows.ids[i : i + 1]
        assert int((ids == image).sum()) == 4  # the processor expanded the image to its 4 tokens
        with torch.inference_mode():
            want = hf(input_ids=ids, **rows.extras[i], output_hidden_states=True).hidden_states[0]
            lookup = hf.get_input_embeddings()(ids)
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
        at = ids[0] == image  # text positions: the embedding; image positions: the tower's features
        assert torch.equal(got[i][0, ~at], lookup[0, ~at]) and not torch.allclose(got[i][0, at], lookup[0, at])


def test_images_reach_the_calibration_and_the_towers_are_copied(vlm, tmp_path):
    model_dir, jsonl = vlm
    rc, out = run_cli("quantize", model_dir, "-r", "fp8-kv8", "--images", jsonl, "-o", tmp_path / "img", *ARGS)
    assert rc == 0, out
    rc, out = run_cli("quantize", model_dir, "-r", "fp8-kv8", "-o", tmp_path / "text", *ARGS)
    assert rc == 0, out
    manifest = json.loads((tmp_path / "img" / "fp8ptq_manifest.json").read_text())
    assert manifest["calibration"]["images"] == {"source": str(jsonl), "samples": 2, "own_arguments": False}
    assert "images" not in json.loads((tmp_path / "text" / "fp8ptq_manifest.json").read_text())["calibration"]
    src, img, text = read_tensors(model_dir), read_tensors(tmp_path / "img"), read_tensors(tmp_path / "text")
    tower = [k for k in src if ".vision_model." in k or ".connector." in k]
    assert tower and all(torch.equal(img[k], src[k]) for k in tower)  # kept as stored
    # static input scales of layer 0 come from calibration: image features change them
    scales = [k for k in img if k.endswith("input_scale") and ".layers.0." in k]
    assert scales and any(not torch.equal(img[k], text[k]) for k in scales)
    config = json.loads((tmp_path / "img" / "config.json").read_text())
    assert config["architectures"] == ["Idefics3ForConditionalGeneration"]
    assert (tmp_path / "img" / "processor_config.json").is_file()


def test_bad_image_input_is_refused_in_one_line(vlm, tiny_dir, tmp_path):
    model_dir, jsonl = vlm
    out = tmp_path / "out"
    rc, text = run_cli("quantize", model_dir, "-r", "fp8-dynamic", "--images", jsonl, "-o", out)
    assert_one_line_error(rc, text, "--images", "data-free")
    rc, text = run_cli("quantize", tiny_dir, "-r", "fp8-kv8", "--images", jsonl, "-o", out, *QUICK)
    assert_one_line_error(rc, text, "no vision tower")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"image": "image0.png", "text": "fine"}\n{"image": 3}\n')
    rc, text = run_cli("quantize", model_dir, "-r", "fp8-kv8", "--images", bad, "-o", out, *QUICK)
    assert_one_line_error(rc, text, "line 2")
    bad.write_text('{"image": "missing.png", "text": "a picture"}\n')
    rc, text = run_cli("quantize", model_dir, "-r", "fp8-kv8", "--images", bad, "-o", out, *QUICK)
    assert_one_line_error(rc, text, "row 1", "missing.png")
    rc, text = run_cli(
        "quantize", model_dir, "-r", "fp8-kv8", "--images", jsonl, "-o", out, *QUICK[:2], "--seq-len", "8"
    )
    assert_one_line_error(rc, text, "row 1", "raise --seq-len")
    assert not out.exists()


def test_image_dependent_layer_inputs_are_named():
    """What makes Qwen-VL's (M-RoPE positions) and Gemma 3's (bidirectional image masks) image rows run
    alone with their own arguments: the first argument that differs from the text-only capture, by path."""
    from fp8ptq.calibrate.images import _differs

    pos = torch.arange(8)[None]
    cos = (torch.ones(1, 8, 4), torch.zeros(1, 8, 4))
    text = {"position_ids": pos, "position_embeddings": cos, "attention_mask": None}
    assert _differs({"position_ids": pos.clone(), "position_embeddings": cos, "attention_mask": None}, text) == ""
    moved = (cos[0], cos[1] + 1)
    assert _differs({**text, "position_embeddings": moved}, text) == "position_embeddings[1]"
    assert _differs({**text, "attention_mask": torch.zeros(1, 1, 8, 8)}, text) == "attention_mask"  # Gemma 3's
    assert _differs((pos + 1,), (pos,), "args") == "args[0]"


@pytest.mark.parametrize("model_type", ["idefics3", "gemma3"])
def test_the_calibration_runs_each_image_row_as_the_model_does(model_type, vlm, tokenizer_dir, tmp_path):
    """The first decoder layer's output for every calibration sample equals transformers' own forward of the
    float model on that sample (image rows with their pixels; text rows as text). Gemma 3 attends both
    ways inside an image: its image rows run alone with their own masks (a shared causal mask would fail
    this at the image's positions); SmolVLM's layers take the text arguments, so its rows share chunks."""
    from transformers import AutoModelForImageTextToText

    from fp8ptq.calibrate.images import image_rows
    from fp8ptq.calibrate.state import CalibrationSetup, observe_layer, prepare
    from fp8ptq.data import BUILTIN, load_samples
    from fp8ptq.models.loader import resolve_model
    from fp8ptq.models.skeleton import materialize
    from fp8ptq.outliers.stats import StatsSpec

    path = vlm[0] if model_type == "idefics3" else write_random_vlm(tmp_path / "m", tokenizer_dir, "gemma3", **DENSE)
    src = resolve_model(str(path))
    tok = src.tokenizer()
    rows = image_rows(str(vlm[1]), src, load_samples(BUILTIN, tok, 3, 48), tok.eos_token_id)
    assert rows.own_arguments == (model_type == "gemma3")
    ids = rows.merged(load_samples(BUILTIN, tok, 3, 48))
    model, state = prepare(src, ids, CalibrationSetup(None, chunk_samples=2, images=rows))
    assert [len(state.chunks.sample_range(c)) for c in state.chunks.owned()] == (
        [1, 1, 1] if rows.own_arguments else [2, 1]
    )
    layer = src.arch.decoder_layers(model)[0]
    materialize(layer, src.arch.layer_prefix(0), src, torch.float32)
    observe_layer(layer, 0, state, StatsSpec(), kv=False, write=True)
    hf = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    for i in range(3):
        extra = rows.extras[i] if i < len(rows) else {}
        with torch.inference_mode():
            want = hf(input_ids=ids[i : i + 1], **extra, output_hidden_states=True).hidden_states[1]
        err = float((state.store.read(i, i + 1) - want).abs().max())
        assert err <= 1e-4 * float(want.abs().max()), (i, err)  # fp32 rounding (another attention kernel)
        if "token_type_ids" in extra:  # the control: Gemma 3 without its image mask computes something else
            causal = {k: v for k, v in extra.items() if k != "token_type_ids"}
            with torch.inference_mode():
                other = hf(input_ids=ids[i : i + 1], **causal, output_hidden_states=True).hidden_states[1]
            # measured: 6.2e-3 against fp8ptq's 1.7e-4 (a rounding at every position, text rows too)
            assert float((other - want).abs().max()) > 10 * max(err, 1e-6), (i, err)
    if rows.own_arguments:  # and through the command: the manifest says the rows ran alone
        rc, out = run_cli("quantize", path, "-r", "fp8-kv8", "--images", vlm[1], "-o", tmp_path / "q", *ARGS)
        assert rc == 0, out
        images = json.loads((tmp_path / "q" / "fp8ptq_manifest.json").read_text())["calibration"]["images"]
        assert images == {"source": str(vlm[1]), "samples": 2, "own_arguments": True}


def test_a_resumed_image_run_equals_the_uninterrupted_one(vlm, tokenizer_dir, tmp_path, monkeypatch):
    """Gemma 3's image rows need their own masks in every layer: a run resumed from layer 1's checkpoint
    (its activations restored, the towers not run again) must still give them theirs."""
    from fp8ptq.api import QuantizeConfig, quantize

    model = write_random_vlm(tmp_path / "gemma3", tokenizer_dir, "gemma3", layers=2, **DENSE)
    kw = dict(recipe="fp8-kv8", images=str(vlm[1]), num_samples=3, seq_len=48, eval_samples=0, weights="rtn")
    kw |= dict(checkpoint_every_s=0.0, recipe_gates=False)
    crash_at_checkpoint(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="simulated kill"):
        quantize(QuantizeConfig(model=str(model), output=tmp_path / "x", **kw))
    monkeypatch.undo()
    from fp8ptq.calibrate.state import RunState

    own_runs, inputs_at = [], RunState.inputs_at

    def spy(self, index, first):
        own_runs.append((index, first)) if first in self.own else None
        return inputs_at(self, index, first)

    monkeypatch.setattr(RunState, "inputs_at", spy)
    resumed = quantize(QuantizeConfig(model=str(model), output=tmp_path / "x", resume=True, **kw))
    assert resumed.run.resumed_from_layer == 1 and resumed.calibration.images.own_arguments
    # layer 1 ran each image row with its own arguments (on this tiny model the outputs alone would not show
    # a shared mask: 4 image tokens do not move the abs-max scales)
    assert {(1, 0), (1, 1)} <= set(own_runs), own_runs
    quantize(QuantizeConfig(model=str(model), output=tmp_path / "y", **kw))
    x, y = read_tensors(tmp_path / "x"), read_tensors(tmp_path / "y")
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
