"""The typed manifest: what a quantize run exposes to gates, strict JSON on disk, optional sections."""

import json
import math

import pytest

from fp8ptq.errors import Fp8ptqError
from fp8ptq.manifest import MANIFEST, Manifest, Quality


def _manifest(**kw) -> Manifest:
    base = dict(
        model="m",
        recipe={"name": "r"},
        versions={"fp8ptq": "0"},
        calibration=None,
        run={
            "device": "cpu",
            "world_size": 1,
            "resumed_from_layer": None,
            "offload_activations": False,
            "chunk_tokens": 8192,
            "chunks_per_rank": None,
        },
        shards=["model-00001-of-00001.safetensors"],
        size_bytes={"source": 200, "output": 100},
        layers=[],
        summary={"layers": 0, "linears_quantized": 0, "linears_skipped": {}, "worst_linear_rel_err": 0.1},
    )
    return Manifest(**{**base, **kw})


def _quality(**kw) -> Quality:
    return Quality(
        **{"tokens": 10, "ppl_reference": 10.0, "ppl": 11.0, "kl": 0.01, "top1": 0.9, "data": "d", "numerics": {}, **kw}
    )


def test_metrics_are_what_gates_read():
    got = _manifest(quality=_quality()).metrics()
    assert got == pytest.approx(
        {"size_ratio": 0.5, "worst_linear_rel_err": 0.1, "kl": 0.01, "top1": 0.9, "ppl": 11.0, "ppl_ratio": 1.1}
    )
    assert set(_manifest().metrics()) == {"size_ratio", "worst_linear_rel_err"}  # no quality check: no quality gates
    m = _manifest()
    m.size_bytes = m.size_bytes.model_copy(update={"weight_bits": 8.0001})
    assert m.metrics()["weight_bits"] == 8.0001  # the size gate that means the same on any model


def test_optional_sections_are_omitted_and_round_trip(tmp_path):
    m = _manifest()
    m.write(tmp_path)
    data = json.loads((tmp_path / MANIFEST).read_text())
    assert "quality" not in data and "mixed" not in data and "speculative" not in data
    assert data["calibration"] is None  # data-free is said, not omitted
    assert list(data.items())[:2] == [("schema", "manifest"), ("schema_version", 1)]
    assert Manifest.load(tmp_path) == m
    # a manifest from before the schema keys still reads; an edited one names its bad field
    del data["schema"], data["schema_version"]
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    assert Manifest.load(tmp_path) == m
    data["summary"].pop("layers")
    (tmp_path / MANIFEST).write_text(json.dumps(data))
    with pytest.raises(Fp8ptqError, match=r"not a valid 'manifest' file: summary.layers: Field required"):
        Manifest.load(tmp_path)


def test_non_finite_numbers_never_reach_the_file(tmp_path):
    with pytest.raises(Fp8ptqError, match="non-finite"):
        _manifest(quality=_quality(kl=math.nan)).write(tmp_path)
    assert not (tmp_path / MANIFEST).exists()
