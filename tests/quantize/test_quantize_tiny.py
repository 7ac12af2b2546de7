"""Tier 2: the whole quantize -> export -> load path on tiny random Llama models."""

import json
from pathlib import Path

import pytest
import torch

from fp8ptq.api import QuantizeConfig, quantize

from helpers import crash_at_checkpoint, read_config, read_tensors

pytestmark = pytest.mark.tiny


def _run(src, out, recipe, **kw):
    cfg = dict(model=str(src), recipe=recipe, output=out, num_samples=4, seq_len=64, eval_samples=2, eval_seq_len=64)
    cfg.update(kw)
    return quantize(QuantizeConfig(**cfg))


@pytest.fixture(scope="module")
def kv8(tmp_path_factory, tiny_sharded_dir):
    out = tmp_path_factory.mktemp("q") / "kv8"
    return out, _run(tiny_sharded_dir, out, "fp8-kv8")


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory, tiny_sharded_dir):
    out = tmp_path_factory.mktemp("q") / "dyn"
    return out, _run(tiny_sharded_dir, out, "fp8-dynamic")


def test_fp8_kv8_tensors(kv8, tiny_sharded_dir):
    out, manifest = kv8
    t = read_tensors(out)
    n_layers = read_config(tiny_sharded_dir)["num_hidden_layers"]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            assert t[f"{p}{m}.weight"].dtype == torch.float8_e4m3fn
            assert t[f"{p}{m}.weight_scale"].shape == (1,)
            assert t[f"{p}{m}.input_scale"].shape == (1,)
        # fused shards share input and weight scales (vLLM fuses them into one GEMM)
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parent = "self_attn" if "q_proj" in group else "mlp"
            for k in ("input_scale", "weight_scale"):
                vals = {float(t[f"{p}{parent}.{m}.{k}"]) for m in group}
                assert len(vals) == 1, (group, k, vals)
        for k in ("k_scale", "v_scale"):
            s = t[f"{p}self_attn.{k}"]
            assert s.shape == (1,) and s > 0
        assert t[f"{p}input_layernorm.weight"].dtype == torch.bfloat16
    assert t["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert manifest.summary.linears_quantized == 7 * n_layers
    assert manifest.quality.kl > 0 and 0 < manifest.quality.top1 <= 1


def test_fp8_kv8_layout(kv8):
    out, _ = kv8
    names = sorted(p.name for p in out.iterdir())
    for f in ("config.json", "fp8ptq_manifest.json", "recipe.yaml", "tokenizer.json", "model.safetensors.index.json"):
        assert f in names
    # a small export is one shard, as save_pretrained writes it (the per-layer files joined at the end)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == sorted(n for n in names if n.endswith(".safetensors")) == ["model.safetensors"]
    qc = read_config(out)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    assert qc["quantization_status"] == "compressed" and qc["ignore"] == ["lm_head"]
    assert qc["kv_cache_scheme"]["type"] == "float" and qc["kv_cache_scheme"]["strategy"] == "tensor"
    g = qc["config_groups"]["group_0"]
    assert g["weights"]["strategy"] == "tensor" and g["input_activations"]["dynamic"] is False
    assert not [p for p in out.parent.iterdir() if ".partial-" in p.name]


def test_fp8_dynamic_tensors(dynamic):
    out, manifest = dynamic
    t = read_tensors(out)
    w = t["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.float8_e4m3fn
    assert t["model.layers.0.mlp.down_proj.weight_scale"].shape == (w.shape[0], 1)
    assert not any(k.endswith(("input_scale", "k_scale", "v_scale")) for k in t)
    assert manifest.calibration is None  # data-free
    g = read_config(out)["quantization_config"]["config_groups"]["group_0"]
    assert g["input_activations"] == {**g["input_activations"], "strategy": "token", "dynamic": True}


def _shard_bytes(path: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def test_runs_are_bit_identical(tmp_path, tiny_dir):
    a = _run(tiny_dir, tmp_path / "a", "fp8-kv8", eval_samples=0)
    b = _run(tiny_dir, tmp_path / "b", "fp8-kv8", eval_samples=0)
    assert _shard_bytes(tmp_path / "a") == _shard_bytes(tmp_path / "b")
    assert a.summary == b.summary


def test_output_exists_needs_overwrite(tmp_path, tiny_dir):
    from fp8ptq.errors import OutputError

    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="already exists"):
        _run(tiny_dir, out, "fp8-dynamic", eval_samples=0)
    assert (out / "keep.txt").read_text() == "mine"
    # --overwrite replaces only what fp8ptq wrote (issue 32): a user's folder stays as it is
    with pytest.raises(OutputError, match="was not written by fp8ptq"):
        _run(tiny_dir, out, "fp8-dynamic", eval_samples=0, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    out.rmdir()
    _run(tiny_dir, out, "fp8-dynamic", eval_samples=0)
    (out / "stale.txt").write_text("from the first run")
    _run(tiny_dir, out, "fp8-dynamic", eval_samples=0, overwrite=True)
    assert (out / "config.json").is_file() and not (out / "stale.txt").exists()


def test_failure_leaves_no_complete_output_and_resumes(tmp_path, tiny_dir, monkeypatch):
    import fp8ptq.runs.finish as jobs

    def boom(*a, **k):
        raise RuntimeError("simulated crash in the middle of writing")

    real = jobs.write_metadata
    monkeypatch.setattr(jobs, "write_metadata", boom)
    with pytest.raises(RuntimeError):
        _run(tiny_dir, tmp_path / "x", "fp8-dynamic", eval_samples=0)
    # finished layers are kept (hidden) for --resume; nothing that looks like an output exists
    assert [p.name for p in tmp_path.iterdir()] == [".x.partial"]
    from fp8ptq.errors import OutputError

    with pytest.raises(OutputError, match="--resume"):
        _run(tiny_dir, tmp_path / "x", "fp8-dynamic", eval_samples=0)
    monkeypatch.setattr(jobs, "write_metadata", real)
    m = _run(tiny_dir, tmp_path / "x", "fp8-dynamic", eval_samples=0, resume=True)
    assert m.run.resumed_from_layer == 2  # both layers were done: only metadata was left
    _run(tiny_dir, tmp_path / "y", "fp8-dynamic", eval_samples=0)
    assert _shard_bytes(tmp_path / "x") == _shard_bytes(tmp_path / "y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x", "y"]


def test_a_crash_between_saving_activations_and_naming_them_resumes_exactly(tmp_path, tiny_sharded_dir, monkeypatch):
    """The window the SIGKILL test hit on a slow machine (tests/e2e/test_scale.py): layer 2's input
    activations are on disk but the state still names layer 1's checkpoint. The resumed run must read
    layer 1's activations, not the newer file, and equal the uninterrupted run bit for bit."""
    kw = dict(eval_samples=0, checkpoint_every_s=0.0)  # a checkpoint after every layer
    crash_at_checkpoint(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="simulated kill"):
        _run(tiny_sharded_dir, tmp_path / "x", "fp8-kv8", **kw)
    monkeypatch.undo()
    resumed = _run(tiny_sharded_dir, tmp_path / "x", "fp8-kv8", resume=True, **kw)
    assert resumed.run.resumed_from_layer == 1
    _run(tiny_sharded_dir, tmp_path / "y", "fp8-kv8", **kw)
    assert _shard_bytes(tmp_path / "x") == _shard_bytes(tmp_path / "y")


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_direct_fp8_packing_equals_general_path(tmp_path, tiny_sharded_dir, monkeypatch, strategy):
    """Data-free FP8 goes straight from source tensor to codes (pack_group_fp8); the general fp32
    fake-quant + compressed-tensors path must give the same bytes, per channel and per tensor (fused
    shards sharing one scale), and the same reports up to summation order."""
    import yaml

    from fp8ptq.quantization.schemes import SCHEMES
    from fp8ptq.recipe import load_recipe

    r = load_recipe("fp8-dynamic").model_dump(mode="json")
    r["scheme"]["weights"]["strategy"] = strategy
    r["gates"] = []
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(r))
    direct = _run(tiny_sharded_dir, tmp_path / "direct", str(recipe), eval_samples=0)
    monkeypatch.setattr(SCHEMES["fp8"], "packs_directly", lambda *a: False)
    general = _run(tiny_sharded_dir, tmp_path / "general", str(recipe), eval_samples=0)
    assert _shard_bytes(tmp_path / "direct") == _shard_bytes(tmp_path / "general")
    for a, b in zip(direct.layers, general.layers):
        assert a["quantized"].keys() == b["quantized"].keys()
        for m in a["quantized"]:
            assert a["quantized"][m]["weight_rel_err"] == pytest.approx(b["quantized"][m]["weight_rel_err"], rel=1e-4)
    if strategy == "tensor":
        t = read_tensors(tmp_path / "direct")
        assert (
            len({float(t[f"model.layers.0.self_attn.{m}.weight_scale"]) for m in ("q_proj", "k_proj", "v_proj")}) == 1
        )


def test_non_layer_tensors_split_across_files(tmp_path, tiny_dir, monkeypatch):
    """Embeddings, final norm and head are written a bounded amount at a time (one file per budget),
    and the index still names every tensor's file."""
    import fp8ptq.export.writer as writer

    monkeypatch.setattr(writer, "REST_FILE_BYTES", 1)  # every non-layer tensor in its own file
    monkeypatch.setattr(writer, "SINGLE_SHARD_BYTES", 0)  # and the files kept as shards (a large export)
    _run(tiny_dir, tmp_path / "q", "fp8-dynamic", eval_samples=0)
    index = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    rest = {n: f for n, f in index.items() if not n.startswith("model.layers.")}
    assert len(rest) >= 2 and len(set(rest.values())) == len(rest)
    from safetensors import safe_open

    for n, f in index.items():
        with safe_open(str(tmp_path / "q" / f), framework="pt") as h:
            assert n in h.keys()


def test_the_writer_thread_checks_what_it_writes(tiny_dir, tmp_path):
    """A layer's tensors are checked for finiteness where they are written (the writer thread, after the
    host copies landed): a NaN a transform left in a float tensor is refused by name, and nothing of that
    layer is on disk; a finite layer is written with its report."""
    from fp8ptq.errors import NonFiniteError
    from fp8ptq.export.writer import CheckpointWriter
    from fp8ptq.models.loader import open_hf_dir
    from fp8ptq.quantization.results import LayerResult

    writer = CheckpointWriter(open_hf_dir(tiny_dir), tmp_path)
    norm = "model.layers.0.input_layernorm.weight"
    bad = torch.ones(64)
    bad[7] = float("nan")
    path, tensors, report, copy = writer.layer_payload(LayerResult(0, "model.layers.0.", float_tensors={norm: bad}))
    assert norm in copy.check and copy.event is None  # nothing in flight on a CPU
    with pytest.raises(NonFiniteError, match=f"'{norm}' has 1 non-finite"):
        writer.write_layer(path, tensors, report, copy)
    assert not list(path.parent.iterdir())
    writer.write_layer(*writer.layer_payload(LayerResult(0, "model.layers.0.", float_tensors={norm: torch.ones(64)})))
    assert path.is_file() and path.with_suffix(".json").is_file()


def test_joined_shard_holds_the_per_layer_tensors(tmp_path, tiny_dir, monkeypatch):
    """The one shard of a small export holds exactly the tensors (names, dtypes, bytes) a large export
    keeps one file per layer for; a large one keeps a shard per layer and one for the rest."""
    from safetensors import safe_open

    import fp8ptq.export.writer as writer

    _run(tiny_dir, tmp_path / "one", "fp8-dynamic", eval_samples=0)
    monkeypatch.setattr(writer, "SINGLE_SHARD_BYTES", 0)
    _run(tiny_dir, tmp_path / "many", "fp8-dynamic", eval_samples=0)

    def tensors(d):
        index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
        out = {}
        for n, f in index.items():
            with safe_open(str(d / f), framework="pt") as h:
                out[n] = h.get_tensor(n)
        return out, sorted(set(index.values()))

    one, one_files = tensors(tmp_path / "one")
    many, many_files = tensors(tmp_path / "many")
    assert one_files == ["model.safetensors"] and len(many_files) == read_config(tiny_dir)["num_hidden_layers"] + 1
    assert one.keys() == many.keys()
    for n in one:
        assert one[n].dtype == many[n].dtype and torch.equal(one[n].view(torch.uint8), many[n].view(torch.uint8)), n
