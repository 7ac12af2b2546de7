"""Hub ids resolve through huggingface_hub: from the local Hugging Face cache with no network."""

from __future__ import annotations

import shutil

import pytest

from fp8ptq.errors import ModelError
from fp8ptq.models.loader import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, tiny_dir, monkeypatch):
    """A Hugging Face cache holding `org/tiny` at `main` (the layout huggingface_hub writes), offline."""
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(tiny_dir, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo


def test_hub_id_resolves_from_the_local_cache_offline(hub_cache):
    src = resolve_model("org/tiny")
    assert src.path == hub_cache / "snapshots" / COMMIT
    assert src.label == "org/tiny"
    assert src.config.model_type == "llama"


def test_hub_id_at_a_commit(hub_cache):
    assert resolve_model("org/tiny", revision=COMMIT).label == f"org/tiny@{COMMIT}"


def test_hub_id_missing_from_the_cache_offline_is_a_clear_error(hub_cache):
    with pytest.raises(ModelError, match="not in the local Hugging Face cache.*HF_HUB_OFFLINE") as err:
        resolve_model("org/absent")
    assert "pass a local directory" in str(err.value)


def test_quantize_a_hub_id(hub_cache, tmp_path):
    from fp8ptq.api import QuantizeConfig, quantize

    manifest = quantize(QuantizeConfig(model="org/tiny", recipe="fp8-dynamic", output=tmp_path / "q", eval_samples=0))
    assert manifest.model == "org/tiny"
    assert (tmp_path / "q" / "config.json").is_file()


def test_a_relative_path_is_never_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="'./org/tiny' not found"):
        resolve_model("./org/tiny")
