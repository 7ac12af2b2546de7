"""Scale (issue 6): memory flat in depth, torch.distributed ranks equal one process, SIGKILL + --resume.

Each test drives the real `fp8ptq` console script in subprocesses, as a user (or torchrun) would."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fp8ptq.models.synthetic import SyntheticSpec, write_synthetic
from fp8ptq.recipe import load_recipe

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def rtn_kv8(tmp_path_factory) -> Path:
    """fp8-kv8 with round-to-nearest weights: calibrated (static inputs + KV), fast."""
    r = load_recipe("fp8-kv8").model_dump(mode="json")
    r["calibration"]["weight_method"] = "rtn"
    r["gates"] = []
    f = tmp_path_factory.mktemp("recipe") / "fp8-kv8-rtn.yaml"
    f.write_text(yaml.safe_dump(r))
    return f


def _quantize_args(model: Path, recipe, out: Path, *extra) -> list[str]:
    return [
        "quantize",
        str(model),
        "-r",
        str(recipe),
        "-o",
        str(out),
        "--num-samples",
        "8",
        "--seq-len",
        "64",
        "--eval-samples",
        "0",
        "--json",
        *extra,
    ]


def _shards(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


def _peak_rss_mib(args: list[str]) -> int:
    """Peak RSS of one `fp8ptq` run, measured in a fresh parent so earlier children do not count."""
    probe = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stderr.write(r.stderr[-3000:]); assert r.returncode == 0, r.returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024)"
    )
    r = subprocess.run(
        [sys.executable, "-c", probe, str(BIN / "fp8ptq"), *args], capture_output=True, text=True, env=ENV, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return int(r.stdout.strip().splitlines()[-1])


def test_peak_rss_flat_in_depth(tmp_path, smol_dir, rtn_kv8):
    # Wide enough that keeping layers around would show: 34 MiB of bf16 weights per layer, so 12 extra
    # layers held in memory would add ~400 MiB (~60%) to the 16-layer run (measured: mmapped shards
    # left open grew 1.0 -> 2.0 GiB).
    spec = dict(hidden=1024, intermediate=4096, heads=16, kv_heads=4)
    shallow = write_synthetic(tmp_path / "d4", smol_dir, SyntheticSpec(layers=4, **spec))
    deep = write_synthetic(tmp_path / "d16", smol_dir, SyntheticSpec(layers=16, **spec))
    rss4 = _peak_rss_mib(_quantize_args(shallow, rtn_kv8, tmp_path / "q4"))
    rss16 = _peak_rss_mib(_quantize_args(deep, rtn_kv8, tmp_path / "q16"))
    print(f"peak RSS: 4 layers {rss4} MiB, 16 layers {rss16} MiB")
    assert rss16 <= 1.15 * rss4, (rss4, rss16)
    # the deep checkpoint is complete and correct: every layer's tensors, loadable, finite
    from fp8ptq.eval.quality import load_simulated
    from fp8ptq.models.loader import open_hf_dir

    out = tmp_path / "q16"
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for i in range(16):
        for k in (
            "self_attn.q_proj.weight",
            "self_attn.q_proj.input_scale",
            "mlp.down_proj.weight_scale",
            "self_attn.k_scale",
            "self_attn.v_scale",
        ):
            assert f"model.layers.{i}.{k}" in index
    import torch

    model = load_simulated(open_hf_dir(out)).model
    with torch.inference_mode():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()


def test_torchrun_two_ranks_equal_one_process(tmp_path, tiny_sharded_dir):
    # 8 samples in chunks of 2 (--chunk-tokens 128 / seq 64): 4 chunks, 2 per rank; GPTQ Hessians,
    # activation maxima and KV maxima are all combined across the ranks.
    one, two = tmp_path / "one", tmp_path / "two"
    args = [
        "--recipe",
        "fp8-kv8",
        "--num-samples",
        "8",
        "--seq-len",
        "64",
        "--chunk-tokens",
        "128",
        "--eval-samples",
        "0",
        "--json",
        "--no-recipe-gates",
    ]
    r = subprocess.run(
        [str(BIN / "fp8ptq"), "quantize", str(tiny_sharded_dir), "-o", str(one), *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(
        [
            str(BIN / "torchrun"),
            "--nproc-per-node",
            "2",
            "-m",
            "fp8ptq",
            "quantize",
            str(tiny_sharded_dir),
            "-o",
            str(two),
            *args,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    m1 = json.loads((one / "fp8ptq_manifest.json").read_text())
    m2 = json.loads((two / "fp8ptq_manifest.json").read_text())
    assert m1["run"]["world_size"] == 1 and m2["run"]["world_size"] == 2
    assert m2["run"]["chunks_per_rank"] == [2, 2]
    assert _shards(one) == _shards(two)  # bit-identical (power-of-two ranks: fixed-tree sums)


def _wait_layers(partial: Path, proc: subprocess.Popen, predicate, timeout: float = 300) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            state = json.loads((partial / "state.json").read_text())
        except (OSError, ValueError):
            state = {}
        if predicate(state):
            return state
        assert proc.poll() is None, f"run ended before the kill point: {proc.stderr.read()[-2000:]}"
        time.sleep(0.05)
    raise AssertionError("kill point not reached")


def test_sigkill_then_resume_matches_uninterrupted(tmp_path, smol_dir, rtn_kv8):
    model = write_synthetic(
        tmp_path / "m", smol_dir, SyntheticSpec(layers=10, hidden=512, intermediate=2048, heads=8, kv_heads=2)
    )
    ref = tmp_path / "ref"
    r = subprocess.run(
        [str(BIN / "fp8ptq"), *_quantize_args(model, rtn_kv8, ref)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = tmp_path / "out"
    partial = tmp_path / ".out.partial"
    kill_points = [
        lambda s: s.get("layers_done", 0) >= 2,  # mid-run
        lambda s: s.get("layers_done", 0) >= 6,  # mid-run again, after a resume
        lambda s: "shards" in s,
    ]  # after the last layer: shards assembled, metadata not yet
    for i, point in enumerate(kill_points):
        extra = ["--resume"] if i else []
        proc = subprocess.Popen(
            [str(BIN / "fp8ptq"), *_quantize_args(model, rtn_kv8, out, *extra)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
        try:
            state = _wait_layers(partial, proc, point)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert not out.exists(), "a killed run must not leave a complete-looking output"
        assert partial.is_dir() and state
    # without --resume the leftover is refused, never silently overwritten
    r = subprocess.run(
        [str(BIN / "fp8ptq"), *_quantize_args(model, rtn_kv8, out)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert r.returncode == 2 and "--resume" in r.stderr
    r = subprocess.run(
        [str(BIN / "fp8ptq"), *_quantize_args(model, rtn_kv8, out, "--resume")],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert not partial.exists() and (out / "fp8ptq_manifest.json").is_file()
    assert _shards(out) == _shards(ref)  # resumed == uninterrupted, bit for bit
    # and a second uninterrupted run is bit-identical too (determinism)
    again = tmp_path / "again"
    r = subprocess.run(
        [str(BIN / "fp8ptq"), *_quantize_args(model, rtn_kv8, again)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=600,
    )
    assert r.returncode == 0 and _shards(again) == _shards(ref)
    shutil.rmtree(tmp_path / "m")
