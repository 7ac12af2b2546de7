"""Offline rotations (R1 + R2) are exact in float, refuse families they do not fit, and cache by source."""

import json
import re

import pytest
import torch

from fp8ptq.errors import RecipeError
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.models.skeleton import load_float
from fp8ptq.outliers.rotate import orthogonal, rotate_model, rotated_source


@pytest.mark.parametrize("n", [16, 64, 576, 96, 7])
def test_orthogonal_is_orthogonal_and_seeded(n):
    q, kind = orthogonal(n, seed=3)
    assert kind == ("random-orthogonal" if n == 7 else "hadamard")
    torch.testing.assert_close(q @ q.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(q, orthogonal(n, seed=3)[0])
    assert not torch.equal(q, orthogonal(n, seed=4)[0])
    if kind == "hadamard":  # every entry +-1/sqrt(n): outliers spread over all channels evenly
        torch.testing.assert_close(q.abs(), torch.full_like(q, n**-0.5))


def _randomize(src_dir, out_dir):
    """A copy of a tiny model with non-trivial norm weights and biases everywhere R1/R2 must carry them."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src_dir, out_dir)
    f = out_dir / "model.safetensors"
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(0)
    for k, v in list(sd.items()):
        if k.endswith("norm.weight"):
            sd[k] = (v.float() * (0.5 + torch.rand(v.shape, generator=g))).to(v.dtype)
    save_file(sd, str(f), metadata={"format": "pt"})
    return out_dir


def _logits(path, ids):
    model = load_float(open_hf_dir(path))
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.tiny
@pytest.mark.parametrize(
    "model_type,kw", [("llama", {}), ("qwen2", {}), ("qwen3", {"tie_word_embeddings": False}), ("phi3", {})]
)
def test_rotation_is_exact_in_float(tiny_model, tmp_path, model_type, kw):
    src = _randomize(tiny_model(model_type, **kw), tmp_path / "src")
    report = rotate_model(open_hf_dir(src), tmp_path / "rot", seed=0, dtype=torch.float32)
    # phi3: q/k/v fused on disk, so R1 only (the adapter names no separate v/o pair for R2)
    assert report.residual == "hadamard" and report.heads == (None if model_type == "phi3" else "hadamard")
    assert report.untied == json.loads((src / "config.json").read_text()).get("tie_word_embeddings", False)
    rot = open_hf_dir(tmp_path / "rot")
    assert rot.config.tie_word_embeddings is False and rot.has("lm_head.weight")
    ids = torch.randint(0, rot.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ref, out = _logits(src, ids), _logits(tmp_path / "rot", ids)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-4 * ref.abs().max().item())
    # the rotation really happened: norms are ones, weights changed, outliers spread
    assert torch.equal(rot.tensor("model.layers.0.input_layernorm.weight"), torch.ones(rot.config.hidden_size))
    name = "model.layers.0.self_attn." + ("qkv_proj" if model_type == "phi3" else "v_proj") + ".weight"
    before, after = open_hf_dir(src).tensor(name).float(), rot.tensor(name)
    assert after.dtype == torch.float32 and not torch.allclose(after, before, atol=1e-2)


@pytest.mark.tiny
def test_rotated_source_is_cached_and_keeps_the_label(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FP8PTQ_CACHE", str(tmp_path / "cache"))
    a, report = rotated_source(open_hf_dir(tiny_dir, label="tiny"), seed=0)
    mtime = (a.path / "rotation.json").stat().st_mtime_ns
    b, again = rotated_source(open_hf_dir(tiny_dir, label="tiny"), seed=0)
    assert a.path == b.path and (b.path / "rotation.json").stat().st_mtime_ns == mtime and report == again
    assert a.label == "tiny" and (a.path / "tokenizer.json").is_file()
    c, _ = rotated_source(open_hf_dir(tiny_dir), seed=1)
    assert c.path != a.path


@pytest.mark.tiny
@pytest.mark.parametrize(
    "model_type,why",
    [("gemma3_text", "(1 + w)"), ("mixtral", "router"), ("qwen3_moe", "router"), ("deepseek_v3", "router")],
)
def test_families_that_do_not_fit_are_refused(tiny_model, tmp_path, model_type, why):
    src = open_hf_dir(tiny_model(model_type))
    with pytest.raises(RecipeError, match=r"transforms: \[rotate\] is not supported .*" + re.escape(why)):
        rotate_model(src, tmp_path / "rot", seed=0)
    assert not (tmp_path / "rot").exists()
