"""`make bench`: every built-in recipe on both real models (SmolLM2-135M and Gemma 3 270M, from the GGUF
files their PyPI packages ship), held to its own quality gates, results as JSON.

    .venv/bin/python benchmarks/quality/recipes_bench.py [--recipes fp8-kv8,nvfp4] [--models gemma3-270m]
        [--full] [--out FILE]

The recipe gates used to be asserted in the test suite (tests/e2e/test_recipes_ci.py, 8 x 256 calibration
tokens, 4 held-out samples). The suite now checks the recipes' mechanics on less calibration (gates
evaluated and printed, exit codes, report); the quality numbers live here, with the same thresholds: by
default the same 8 x 256 calibration and 4 evaluation samples the gates were set for, `--full` each
recipe's own calibration (64 x 512 for most: hours on a 2-core CPU for the 4-bit searches) and 8
evaluation samples. Exit 1 when any recipe fails to run or misses a gate.

Each recipe runs `fp8ptq quantize` in its own process (probe.child: wall time and peak RSS of that
process alone). The JSON (default benchmarks/results/recipes.json) carries the commit, the machine and
the command of every row; BENCHMARKS.md's recipe table cites it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the shared probe.py
from probe import child  # noqa: E402

MODELS = ("smollm2-135m", "gemma3-270m")
# SmolLM2's widths (576, 1536) take 64, not the recipes' 128 defaults: what its users pass (Gemma 3 270M's
# 640, 1024 and 2048 take 128)
OPTIONS = {"smollm2-135m": {"fp8-block": ["--block-size", "64"], "w4a8-fp8": ["--group-size", "64"]}}
CI_CALIBRATION = ["--num-samples", "8", "--seq-len", "256", "--eval-samples", "4"]
FULL_CALIBRATION = ["--eval-samples", "8"]


def builtin_recipes() -> list[str]:
    return sorted(p.stem for p in (REPO / "fp8ptq" / "recipes").glob("*.yaml"))


def machine() -> dict:
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "avx512": "avx512f" in flags,
        "vnni": "avx512_vnni" in flags or "avx_vnni" in flags,
        "load_avg_at_start": os.getloadavg()[0],
    }


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "fp8ptq"], capture_output=True, text=True, cwd=REPO)
    return r.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def run_recipe(name: str, out: Path, calibration: list[str], model: str = MODELS[0]) -> dict:
    cmd = [str(Path(sys.executable).parent / "fp8ptq"), "quantize", model, "-r", name, "-o", str(out)]
    cmd += [*calibration, *OPTIONS.get(model, {}).get(name, []), "--overwrite", "--json"]
    meta, lines, err = child(cmd)
    row = {"recipe": name, "model": model, "command": " ".join(["fp8ptq", *cmd[1:]]), "exit": meta["rc"]}
    row["wall_s"] = meta["wall"]
    row["peak_rss_mib"] = meta["rss"]
    manifest = out / "fp8ptq_manifest.json"
    if not manifest.is_file():
        row["error"] = err[-2000:]
        return row
    m = json.loads(manifest.read_text())
    row["quality"] = m.get("quality")
    row["weight_bits"] = (m.get("size_bytes") or {}).get("weight_bits")
    row["gates"] = m.get("gates")
    row["calibration_tokens"] = (m.get("calibration") or {}).get("tokens")
    row["passed"] = meta["rc"] == 0 and bool(m.get("gates")) and all(g["passed"] for g in m["gates"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(builtin_recipes()), help="comma-separated (default: all built-in)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated (default: both real models)")
    ap.add_argument("--full", action="store_true", help="each recipe's own calibration instead of 8 x 256")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "recipes.json")
    args = ap.parse_args()
    calibration = FULL_CALIBRATION if args.full else CI_CALIBRATION
    result = {"commit": commit(), "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result["calibration"] = "recipe default" if args.full else "8 x 256, 4 eval samples"
    rows = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fp8ptq-bench-") as tmp:
        for model in args.models.split(","):
            for name in args.recipes.split(","):
                row = run_recipe(name, Path(tmp) / name, calibration, model)
                rows.append(row)
                gates = ", ".join(f"{g['gate']}: {'pass' if g['passed'] else 'FAIL'}" for g in row.get("gates") or [])
                q = row.get("quality") or {}
                print(
                    f"{model} {name}: exit {row['exit']}, {row['wall_s']:.0f} s, KL {q.get('kl')}, {gates}", flush=True
                )
                result["recipes"] = rows  # written after every row: a long run stopped keeps what it measured
                args.out.write_text(json.dumps(result, indent=2) + "\n")
    failed = [f"{r['model']} {r['recipe']}" for r in rows if not r.get("passed")]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
