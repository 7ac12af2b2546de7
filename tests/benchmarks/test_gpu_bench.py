"""benchmarks/speed/gpu_bench.py end to end on the CPU with a tiny Llama: the one-command GPU benchmark runs
(every fp8ptq row, timings, memory, KL from the shared evaluator) wherever the test suite runs; on a GPU
machine the same command with --device cuda and the 8B shape is the measurement."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "speed"


@pytest.mark.slow  # three quantize processes and four evaluations: ~1 min quiet, 4 min contended
def test_gpu_bench_runs_on_cpu(tmp_path, tokenizer_dir):
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(BENCH))
    work = tmp_path / "work"
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    tiny = "--layers 2 --hidden 64 --intermediate 128 --heads 4 --kv-heads 2 --vocab 1024".split()
    args = [*tiny, "--device", "cpu", "--num-samples", "4", "--seq-len", "64", "--eval-samples", "2"]
    plan = ["--plan", "0,1,2,3,4,5"]  # fp8ptq's three defaults beside llm-compressor's (not the matched W4A16 row)
    rows = gpu_bench.main([*args, *plan, "--work", str(work), "--json", str(tmp_path / "rows.json")])

    fp8ptq = {r["run"]: r for r in rows if r["tool"] == "fp8ptq"}
    assert set(fp8ptq) == {"fp8-kv8 RTN", "fp8-kv8 GPTQ (default)", "w4a16 g64 GPTQ"}
    for r in fp8ptq.values():
        assert r["memory"] == "RSS" and r["peak_mib"] > 100  # a torch process on the CPU
        assert 0 < r["quantize_s"] < r["process_s"]
        assert math.isfinite(r["kl"]) and r["kl"] > 0  # quantized: not the reference
        assert (Path(r["out"]) / "config.json").is_file()
    # 4-bit weights lose more than FP8 on the same model and tokens
    assert fp8ptq["w4a16 g64 GPTQ"]["kl"] > fp8ptq["fp8-kv8 GPTQ (default)"]["kl"]
    saved = json.loads((tmp_path / "rows.json").read_text())
    llmc = [r for r in rows if r["tool"] == "llm-compressor"]
    if gpu_bench.LLMC_PY.is_file():  # the peer's venv is there: its rows must be too
        assert {r["run"] for r in llmc} == {"fp8-kv8 oneshot", "fp8-kv8 GPTQ", "w4a16 g64 GPTQ"}
    else:  # not installed here: the output says so instead of pretending
        assert llmc == [] and saved["llmc"].startswith("not run: no llm-compressor")
    assert saved["medians"] and all(m["repeats"] == 1 for m in saved["medians"])


def test_gpu_bench_medians_keep_every_sample():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_bench
    finally:
        sys.path.remove(str(BENCH))
    row = dict(tool="fp8ptq", run="GPTQ", peak_mib=10.0, memory="GPU", kl=0.02)
    rows = [{**row, "quantize_s": q, "process_s": p} for q, p in ((9.0, 30.0), (7.0, 31.0), (8.0, 20.0))]
    rows.append({**row, "tool": "llm-compressor", "quantize_s": 5.0, "process_s": 25.0})
    m = {x["tool"]: x for x in gpu_bench.medians(rows)}
    assert (m["fp8ptq"]["quantize_s"], m["fp8ptq"]["process_s"], m["fp8ptq"]["repeats"]) == (8.0, 30.0, 3)
    assert m["fp8ptq"]["quantize_samples"] == [9.0, 7.0, 8.0]
    assert m["llm-compressor"]["repeats"] == 1
