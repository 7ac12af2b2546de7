"""How fp8ptq's time and peak RSS grow with depth, width and calibration tokens, on synthetic Llama-shaped
models generated on the fly (random weights with injected outlier channels, sharded safetensors), and
how fast the data-free fp8-dynamic conversion runs next to the disk's own read+write speed.

    .venv/bin/python benchmarks/speed/scale.py [--work /tmp/fp8ptq-scale] [--png docs/scale.png] [--quick]
        [--llmc [--llmc-shape 8x2048x8192] | --only-llmc | --only-data-free]

Every point is one `fp8ptq quantize` subprocess (recipe fp8-kv8: static FP8 inputs, FP8 KV, GPTQ);
peak RSS is that process's ru_maxrss. Prints markdown tables for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: probe.py, llmc_quantize.py, .venv-llmc
sys.path.insert(0, str(BENCH))
from probe import child  # noqa: E402

BIN = Path(sys.executable).parent


def run(args: list[str]) -> dict:
    """One fp8ptq run: wall seconds, peak RSS MiB (measured in a fresh parent), the manifest."""
    meta, lines, err = child([str(BIN / "fp8ptq"), *args])
    if meta["rc"] != 0:
        raise SystemExit(f"fp8ptq {' '.join(args[:4])} failed:\n{err}")
    meta["manifest"] = json.loads("\n".join(lines))
    return meta


def quantize(model: Path, out: Path, recipe: str, samples: int, seq: int, *extra) -> dict:
    return run(
        [
            "quantize",
            str(model),
            "-r",
            recipe,
            "-o",
            str(out),
            "--overwrite",
            "--eval-samples",
            "0",
            "--json",
            "--no-recipe-gates",
            "--num-samples",
            str(samples),
            "--seq-len",
            str(seq),
            *extra,
        ]
    )


def disk_copy_mb_s(src: Path, dst: Path) -> float:
    """Read+write throughput of the disk on the same files: copy the shards and fsync them."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    files = sorted(src.glob("*.safetensors"))
    t = time.perf_counter()
    for f in files:
        with open(f, "rb") as i, open(dst / f.name, "wb") as o:
            shutil.copyfileobj(i, o, 16 << 20)
            o.flush()
            os.fsync(o.fileno())
    secs = time.perf_counter() - t
    shutil.rmtree(dst)
    return sum(f.stat().st_size for f in files) / 2**20 / secs


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def drop_caches() -> None:
    """Empty the page cache (root only) so the next read comes from the disk, not from memory."""
    os.sync()
    DROP_CACHES.write_text("3\n")


def data_free(big: Path, work: Path, repeats: int = 3) -> None:
    """Data-free fp8-dynamic conversion (layers + non-layer tensors + index, i.e. quantize_s + assemble_s;
    process start-up and metadata excluded) vs a plain copy of the same shards, both with a warm page
    cache and, where the page cache can be dropped, cold. Median of `repeats`."""
    import statistics

    in_mb = sum(f.stat().st_size for f in big.glob("*.safetensors")) / 2**20
    modes = ["warm"] + (["cold"] if os.access(DROP_CACHES, os.W_OK) else [])
    for mode in modes:
        conv, disk, rss = [], [], 0.0
        for _ in range(repeats):
            if mode == "cold":
                drop_caches()
            r = run(
                [
                    "quantize",
                    str(big),
                    "-r",
                    "fp8-dynamic",
                    "-o",
                    str(work / "dyn"),
                    "--overwrite",
                    "--eval-samples",
                    "0",
                    "--json",
                    "--no-recipe-gates",
                ]
            )
            t = r["manifest"]["timings"]
            conv.append(in_mb / (t["quantize_s"] + t["assemble_s"]))
            rss = max(rss, r["rss"])
            if mode == "cold":
                drop_caches()
            disk.append(disk_copy_mb_s(big, work / "copy"))
        c, d = statistics.median(conv), statistics.median(disk)
        print(
            f"data-free fp8-dynamic, {mode} page cache, {in_mb:.0f} MiB of bf16 shards: {c:.0f} MiB/s of input "
            f"(runs {', '.join(f'{v:.0f}' for v in conv)}; peak RSS {rss:.0f} MiB); disk copy (read + write + fsync) "
            f"of the same shards: {d:.0f} MiB/s (runs {', '.join(f'{v:.0f}' for v in disk)}) -> {c / d:.2f}x",
            flush=True,
        )


def compare_llmc(model_dir: Path, work: Path, samples: int, seq: int, offload_only: bool = False) -> None:
    """fp8-kv8 on the same synthetic model and the same calibration tokens: fp8ptq (default, and with
    --offload-activations --chunk-tokens 1024) vs llm-compressor (benchmarks/setup_llmc_venv.sh)."""
    from safetensors.torch import save_file

    from fp8ptq.data import load_samples
    from fp8ptq.models.loader import open_hf_dir

    ids = load_samples("builtin", open_hf_dir(model_dir).tokenizer(), samples, seq, "calibration", 0)
    calib = work / "calib-scale.safetensors"
    save_file({"input_ids": ids.contiguous()}, str(calib))
    rows = []
    offload = ("--offload-activations", "--chunk-tokens", "1024")
    for extra in [offload] if offload_only else [(), offload]:
        r = quantize(model_dir, work / "cmp-fp8ptq", "fp8-kv8", samples, seq, *extra)
        rows.append((f"fp8ptq {' '.join(extra)}".strip(), r["manifest"]["timings"]["quantize_s"], r["wall"], r["rss"]))
    llmc = BENCH / ".venv-llmc" / "bin" / "python"
    meta, lines, err = child(
        [
            str(llmc),
            str(BENCH / "llmc_quantize.py"),
            "--model",
            str(model_dir),
            "--calib",
            str(calib),
            "--scheme",
            "fp8-kv8",
            "--out",
            str(work / "cmp-llmc"),
        ]
    )
    if meta["rc"] == 0:
        info = json.loads(lines[-1])
        rows.append(("llm-compressor 0.14", info["quantize_wall_s"], meta["wall"], meta["rss"]))
    else:
        print(f"llm-compressor failed: {err[-1500:]}")
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / 2**20
    print(f"\nfp8-kv8 on {model_dir.name} ({size:.0f} MiB bf16), {samples}x{seq} calibration tokens\n")
    print("| tool | calib+quant s | process s | peak RSS MiB |\n|---|---:|---:|---:|")
    for name, q, w, rss in rows:
        print(f"| {name} | {q:.1f} | {w:.1f} | {rss:.0f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-scale"))
    ap.add_argument("--png", type=Path, default=Path("docs/scale.png"))
    ap.add_argument("--quick", action="store_true", help="fewer, smaller points")
    ap.add_argument(
        "--llmc", action="store_true", help="also llm-compressor (fp8-kv8) on the deepest model, same tokens"
    )
    ap.add_argument("--only-llmc", action="store_true", help="skip the sweeps")
    ap.add_argument(
        "--llmc-offload-only", action="store_true", help="with --llmc: fp8ptq only with --offload-activations"
    )
    ap.add_argument("--only-data-free", action="store_true", help="only the data-free conversion vs disk copy")
    ap.add_argument(
        "--llmc-shape",
        default=None,
        help="LAYERSxHIDDENxINTERMEDIATE of the synthetic model for --llmc "
        "(default: the deepest sweep model, hidden 1024)",
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fp8ptq.models.loader import resolve_model
    from fp8ptq.models.synthetic import SyntheticSpec, write_synthetic

    tok = resolve_model("smollm2-135m").path
    args.work.mkdir(parents=True, exist_ok=True)

    def model(layers, hidden, inter):
        d = args.work / f"m-{layers}x{hidden}x{inter}"
        if not (d / "config.json").is_file():
            write_synthetic(
                d,
                tok,
                SyntheticSpec(
                    layers=layers, hidden=hidden, intermediate=inter, heads=hidden // 64, kv_heads=max(1, hidden // 256)
                ),
            )
        return d

    rows = []

    def point(kind, layers, hidden, inter, samples, seq, *extra):
        m = model(layers, hidden, inter)
        r = quantize(m, args.work / "out", "fp8-kv8", samples, seq, *extra)
        rows.append(
            dict(
                kind=kind,
                layers=layers,
                hidden=hidden,
                intermediate=inter,
                tokens=samples * seq,
                offload="--offload-activations" in extra,
                wall=r["wall"],
                rss=r["rss"],
                quantize_s=r["manifest"]["timings"]["quantize_s"],
            )
        )
        print(json.dumps(rows[-1]), flush=True)

    depths = [2, 4, 8] if args.quick else [2, 4, 8, 16]
    if args.only_data_free:
        return data_free(model(8 if args.quick else 16, 2048, 8192), args.work)
    if args.llmc or args.only_llmc:
        shape = [int(v) for v in args.llmc_shape.split("x")] if args.llmc_shape else [depths[-1], 1024, 4096]
        compare_llmc(model(*shape), args.work, 16, 256, args.llmc_offload_only)
    if args.only_llmc:
        return
    for n in depths:
        point("depth", n, 1024, 4096, 16, 256)
    for h in [512, 1024] if args.quick else [512, 1024, 2048]:
        point("width", 4, h, 4 * h, 16, 256)
    for s in [8, 32] if args.quick else [8, 32, 128]:
        point("tokens", 4, 1024, 4096, s, 256)
        point("tokens", 4, 1024, 4096, s, 256, "--offload-activations")

    data_free(model(8 if args.quick else 16, 2048, 8192), args.work)

    print(
        "\n| sweep | layers | hidden / intermediate | calib tokens | activations | calib+quant s | process s | peak RSS MiB |"
    )
    print("|---|---:|---|---:|---|---:|---:|---:|")
    for r_ in rows:
        print(
            f"| {r_['kind']} | {r_['layers']} | {r_['hidden']} / {r_['intermediate']} | {r_['tokens']} | "
            f"{'disk' if r_['offload'] else 'RAM'} | {r_['quantize_s']:.1f} | {r_['wall']:.1f} | {r_['rss']:.0f} |"
        )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, kind, key, label in (
        (axes[0], "depth", "layers", "decoder layers (hidden 1024)"),
        (axes[1], "width", "hidden", "hidden size (4 layers)"),
        (axes[2], "tokens", "tokens", "calibration tokens (4 x 1024)"),
    ):
        for off in (False, True):
            pts = sorted(
                (r_[key], r_["quantize_s"], r_["rss"]) for r_ in rows if r_["kind"] == kind and r_["offload"] == off
            )
            if not pts:
                continue
            tag = " (activations on disk)" if off else ""
            ax.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=f"peak RSS MiB{tag}")
            ax.plot(
                [p[0] for p in pts],
                [p[1] * 10 for p in pts],
                marker="s",
                linestyle="--",
                label=f"calib+quant s x10{tag}",
            )
        ax.set_xlabel(label)
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("fp8ptq quantize (fp8-kv8, GPTQ) on synthetic Llama-shaped models")
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110, bbox_inches="tight")
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
