"""Where the calibrate+quantize time of one fp8ptq run goes on a GPU: host regions and device kernels.

    PYTHONPATH=$PWD python3 benchmarks/speed/gpu_profile.py --layers 4 --weights rtn [--compute-dtype tf32] \
        [--work /tmp/fp8ptq-gpubench] [--json out.json]

The synthetic Llama-3-8B-width model and calibration tokens of benchmarks/speed/gpu_bench.py (same --work cache).
One quantize (fp8-kv8; --weights rtn|gptq) runs in this process under torch.profiler, with fp8ptq's own
steps labelled (record_function around the calibration's passes and stages, the layer reader, the
writer, the embedding lookup, the assembly). Printed, and written to --json: the run's timings, each
labelled region's host time (CPU total: time the host spent inside it, waits on the device included),
the device's busy time (sum of kernel times) and the top kernels. Profiling adds overhead: compare
regions with each other, not this wall with gpu_bench's.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import wraps
from pathlib import Path

import torch

REGIONS = {  # module -> attributes (functions or Class.method) labelled in the profile
    "fp8ptq.calibrate.pipeline": [
        "prepare", "materialize", "quantize_group", "LayerCalibrator._pass", "LayerCalibrator._stage_stats",
        "LayerCalibrator.quantize_stage", "LayerCalibrator.quantize_kv", "LayerCalibrator._output_from_cache",
        "LayerCalibrator.stage_order", "plan_layer",
    ],
    "fp8ptq.models.prefetch": ["LayerPrefetch.load", "LayerPrefetch.start"],
    "fp8ptq.export.writer": ["CheckpointWriter.layer_payload", "CheckpointWriter.write_layer", "CheckpointWriter.finish"],
    "fp8ptq.runs.calibrated": ["calibrate"],
    "fp8ptq.runs.finish": ["finish"],
    "fp8ptq.calibrate.state": ["ActivationStore.write"],
}  # fmt: skip


# the profiler's own bookkeeping, reported as device activities (first call on an H100, 2026-11-26)
PROFILER_OWN = {"Command Buffer Full", "Activity Buffer Request", "Buffer Flush", "Lazy Function Loading"}


def _label(module: str, attr: str) -> None:
    import importlib

    mod = importlib.import_module(module)
    owner, name = (mod, attr) if "." not in attr else (getattr(mod, attr.split(".")[0]), attr.split(".")[1])
    if not hasattr(owner, name):
        print(f"(no {module}.{attr} to label)")
        return
    fn = getattr(owner, name)

    @wraps(fn)
    def labelled(*a, **k):
        with torch.profiler.record_function(f"fp8ptq::{attr}"):
            return fn(*a, **k)

    setattr(owner, name, labelled)


def main(argv: list[str] | None = None) -> dict:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--weights", default="rtn")
    ap.add_argument("--compute-dtype", default="auto")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-gpubench"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--top", type=int, default=25)
    a, rest = ap.parse_known_args(argv)
    ga = argparse.Namespace(
        layers=a.layers, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256, num_samples=64,
        seq_len=512, work=a.work,
    )  # fmt: skip
    for k, v in zip(rest[::2], rest[1::2]):  # --hidden 64 ... (a CPU dry run)
        setattr(ga, k.lstrip("-").replace("-", "_"), int(v))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    a.work.mkdir(parents=True, exist_ok=True)
    src, _calib = gpu_bench.build(ga)
    for module, attrs in REGIONS.items():
        for attr in attrs:
            _label(module, attr)
    from fp8ptq.api import QuantizeConfig, quantize

    cuda = a.device.startswith("cuda")
    if cuda:
        torch.empty(1, device=a.device)
    cfg = QuantizeConfig(
        model=str(src), recipe="fp8-kv8", output=a.work / "profiled", overwrite=True, num_samples=ga.num_samples,
        seq_len=ga.seq_len, eval_samples=0, device=a.device, weights=a.weights, compute_dtype=a.compute_dtype,
    )  # fmt: skip
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        m = quantize(cfg)
    events = prof.key_averages()
    regions = sorted(
        ({"region": e.key, "calls": e.count, "host_s": e.cpu_time_total / 1e6} for e in events if "fp8ptq::" in e.key),
        key=lambda r: -r["host_s"],
    )
    dev = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    self_dev = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    # device activities only (kernels, copies): a CPU op carries its kernels' time too, a label its range
    kernels = sorted(
        (
            {"op": e.key, "calls": e.count, "device_s": getattr(e, self_dev) / 1e6}
            for e in events
            if getattr(e, self_dev, 0) > 0
            and getattr(e, "device_type", None) != torch.autograd.DeviceType.CPU
            and not e.key.startswith("fp8ptq::")
            and e.key not in PROFILER_OWN
        ),
        key=lambda r: -r["device_s"],
    )
    out = {
        "run": {"weights": a.weights, "compute_dtype": m.run.compute_dtype, "layers": a.layers, "device": a.device},
        "timings": m.timings,
        "device_busy_s": sum(k["device_s"] for k in kernels),
        "launches": sum(k["calls"] for k in kernels),
        "regions": regions,
        "kernels": kernels[: a.top],
        "dev_field": dev,
    }
    print(json.dumps({k: out[k] for k in ("run", "timings", "device_busy_s", "launches")}))
    print("| region | calls | host s |\n|---|---:|---:|")
    for r in regions:
        print(f"| {r['region']} | {r['calls']} | {r['host_s']:.3f} |")
    print("| kernel / op | calls | device s |\n|---|---:|---:|")
    for k in kernels[: a.top]:
        print(f"| {k['op'][:90]} | {k['calls']} | {k['device_s']:.3f} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
