"""Peak RSS and time of `fp8ptq quantize -r fp8-kv8` on a synthetic MoE model with Qwen3-30B-A3B's layer
shape (hidden 2048, 128 experts, moe_intermediate 768, top-8, 32 query / 4 KV heads of 128), random
bf16 weights, a 1024-token in-process tokenizer (so the embedding is small and RSS is the layers'),
next to what one layer and the activation store weigh; and llm-compressor's FP8 + KV8 on the same
model and tokens when its venv exists (benchmarks/setup_llmc_venv.sh).

    .venv/bin/python benchmarks/speed/moe_memory.py [--layers 2] [--samples 16] [--seq 256] [--work /tmp/fp8ptq-moe]

Prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]  # benchmarks/: probe.py, llmc_quantize.py, .venv-llmc
sys.path.insert(0, str(BENCH))
from probe import child  # noqa: E402

BIN = Path(sys.executable).parent
SHAPE = dict(
    hidden_size=2048,
    moe_intermediate_size=768,
    intermediate_size=6144,
    num_experts=128,
    num_experts_per_tok=8,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


def build(work: Path, layers: int) -> Path:
    from fp8ptq.models.synthetic import write_random, write_tokenizer

    model = work / f"qwen3moe-30b-shape-{layers}l"
    if not (model / "config.json").is_file():
        tok = write_tokenizer(work / "tokenizer")
        write_random(model, "qwen3_moe", tok, layers=layers, shards=layers, init_bf16=True, **SHAPE)
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-moe"))
    ap.add_argument("--no-llmc", action="store_true", help="fp8ptq only")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    model = build(a.work, a.layers)
    disk = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    h, e, i = SHAPE["hidden_size"], SHAPE["num_experts"], SHAPE["moe_intermediate_size"]
    q, kv = SHAPE["num_attention_heads"] * SHAPE["head_dim"], SHAPE["num_key_value_heads"] * SHAPE["head_dim"]
    layer_params = e * 3 * h * i + h * (q + 2 * kv) + q * h + e * h
    out = a.work / "fp8ptq-out"
    meta, lines, err = child(
        [
            str(BIN / "fp8ptq"),
            "quantize",
            str(model),
            "-r",
            "fp8-kv8",
            "-o",
            str(out),
            "--num-samples",
            str(a.samples),
            "--seq-len",
            str(a.seq),
            "--eval-samples",
            "0",
            "--no-recipe-gates",
            "--overwrite",
            "--json",
        ]
    )
    if meta["rc"] != 0:
        raise SystemExit(f"fp8ptq failed:\n{err}")
    manifest = json.loads("\n".join(lines))
    mib = 1 << 20
    print(f"model: {a.layers} layers of Qwen3-30B-A3B shape, {disk / mib:.0f} MiB bf16 on disk")
    print(f"calibration: {a.samples} x {a.seq} tokens\n")
    print("| tool | peak RSS MiB | wall s | one layer fp32 MiB | activation store MiB |")
    print("|---|---|---|---|---|")
    store = a.samples * a.seq * h * 4
    print(
        f"| fp8ptq fp8-kv8 | {meta['rss']:.0f} | {meta['wall']:.0f} | {layer_params * 4 / mib:.0f} | "
        f"{store / mib:.0f} |"
    )
    print(f"\nfp8ptq timings: {json.dumps(manifest['timings'])}")
    tokens = [sum(x["tokens"]) for layer in manifest["layers"] for x in layer["experts"].values()]
    starved = [len(x["all_tokens"]) for layer in manifest["layers"] for x in layer["experts"].values()]
    print(f"routed pairs per layer: {tokens}; experts calibrated on all tokens per layer: {starved}")
    llmc = BENCH / ".venv-llmc" / "bin" / "python"
    if a.no_llmc:
        return
    if not llmc.is_file():
        print("\nllm-compressor: not run (no benchmarks/.venv-llmc; run benchmarks/setup_llmc_venv.sh)")
        return
    from safetensors.torch import save_file

    from fp8ptq.data import load_samples
    from fp8ptq.models.loader import open_hf_dir

    ids = load_samples("builtin", open_hf_dir(model).tokenizer(), a.samples, a.seq, "calibration", 0)
    calib = a.work / "calib.safetensors"
    save_file({"input_ids": ids.contiguous()}, str(calib))
    cmd = [str(llmc), str(BENCH / "llmc_quantize.py"), "--model", str(model), "--calib", str(calib)]
    meta, lines, err = child([*cmd, "--scheme", "fp8-kv8", "--out", str(a.work / "llmc-out")])
    if meta["rc"] != 0:
        print(f"\nllm-compressor 0.14 fp8-kv8 failed (peak RSS {meta['rss']:.0f} MiB, {meta['wall']:.0f} s):")
        print(err[-1500:])
        return
    info = json.loads(lines[-1])
    print(f"| llm-compressor 0.14 fp8-kv8 | {meta['rss']:.0f} | {meta['wall']:.0f} | | |")
    print(f"llm-compressor oneshot s: {info['quantize_wall_s']:.0f}")


if __name__ == "__main__":
    main()
