"""llama.cpp as a real engine for fp8ptq's GGUF exports (issue 39 item 4): each GGUF is loaded by llama.cpp
(llama-cpp-python, `make llama`), which scores held-out text; fp8ptq's simulation of the same file (gguf-py's
dequantization through transformers' GGUF loader, fp32) scores the same token ids. Per export:

  quant KL      KL(bf16 model || simulation): the quantization's own effect (what fp8ptq reports)
  engine |dlogp| mean |log p_llama.cpp - log p_simulation| of the actual next tokens, and the KL between them:
                how closely llama.cpp computes what fp8ptq simulated (llama.cpp also quantizes activations
                to 8 bits inside its K-quant / Q4_0 dot products, so it is not 0)
  greedy        llama.cpp's greedy continuation (token ids, 32 new) vs the simulation's: tokens equal before
                the first difference, and llama.cpp's text
The F32 file (no weight quantization) is the control: its gap is llama.cpp's own arithmetic (8-bit
activations in quantized dot products, an F16 KV cache). Exports: fp8ptq's `--gguf-type` Q8_0, Q6_K, Q4_K_M and Q4_0 of the float model, Q4_K_M with
`--importance builtin`, the calibrated `w4a16-gguf`
export carried as exact Q4_0 codes (--calibrated), and llama.cpp's own Q4_K_M / Q4_0 (llama_model_quantize,
no importance matrix) of fp8ptq's F32 GGUF, for the quality comparison.

    make llama && .venv/bin/python benchmarks/engines/llamacpp_check.py [--work /tmp/fp8ptq-llamacpp] [--calibrated]

Writes benchmarks/results/llamacpp.json (BENCHMARKS.md's GGUF table is rendered from it: benchmarks/render_tables.py;
relabel `machine` with the page's name for the machine and set `link` to the notebook section) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
LLAMA_PY = ROOT / ".venv-llama" / "bin" / "python"
WORKER = Path(__file__).resolve().parent / "llamacpp_worker.py"


def worker(*args) -> str:
    r = subprocess.run([str(LLAMA_PY), str(WORKER), *map(str, args)], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama.cpp worker {args[0]} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def tokens_of(model_dir: Path, rows: int, seq: int) -> np.ndarray:
    from transformers import AutoTokenizer

    from fp8ptq.data import builtin_texts

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok("\n\n".join(builtin_texts("evaluation")), add_special_tokens=False)["input_ids"]
    return np.array(ids[: rows * seq], dtype=np.int32).reshape(rows, seq)


@torch.inference_mode()
def simulate(path: Path, tokens: np.ndarray, new: int, prompt_len: int) -> tuple[torch.Tensor, list[int]]:
    """Log-probs [rows, T, V] of a model (HF dir, or .gguf through transformers) and its greedy ids."""
    from transformers import AutoModelForCausalLM

    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = torch.from_numpy(tokens).long()
    lp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    prompt = ids[:1, :prompt_len]
    out = model.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return lp, out[0, prompt_len:].tolist()


def tokenizer_agreement(gguf: Path, model_dir: Path, work: Path) -> dict:
    """llama.cpp's tokenization of held-out texts (and a few edge cases) vs transformers' on the same tokenizer."""
    from transformers import AutoTokenizer

    from fp8ptq.data import builtin_texts

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    texts = [t[:600] for t in builtin_texts("evaluation")[:40]]
    texts += [
        "Hello world! 12345 don't  multiple   spaces\n\ttabs",
        "<|im_start|>user\nHi<|im_end|>",
        "x = f(a, b)  # é ü 中文",
    ]
    (work / "texts.json").write_text(json.dumps(texts))
    ours = json.loads(worker("tokenize", gguf, work / "texts.json"))
    hf = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return {"texts": len(texts), "equal": sum(a == b for a, b in zip(ours, hf))}


def compare(ref: torch.Tensor, sim: torch.Tensor, eng: torch.Tensor, tokens: np.ndarray) -> dict:
    nxt = torch.from_numpy(tokens[:, 1:]).long().unsqueeze(-1)
    pick = lambda lp: lp[:, :-1].gather(-1, nxt).squeeze(-1)  # noqa: E731
    kl = lambda p, q: float((p.exp() * (p - q)).sum(-1).mean())  # noqa: E731
    return {
        "quant_kl": kl(ref, sim),
        "quant_dlogp": float((pick(sim) - pick(ref)).abs().mean()),
        "engine_kl": kl(sim, eng),
        "engine_dlogp": float((pick(eng) - pick(sim)).abs().mean()),
        "engine_top1": float((eng.argmax(-1) == sim.argmax(-1)).float().mean()),
        "llama_quant_kl": kl(ref, eng),
    }


def commit() -> str:
    """The checkout's short commit, "-dirty" when fp8ptq/ has uncommitted changes (as recipes_bench.py)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "fp8ptq"], cwd=ROOT, capture_output=True, text=True)
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def main() -> None:
    from transformers import AutoTokenizer

    from fp8ptq.api import ConvertConfig, convert
    from fp8ptq.models import resolve_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-llamacpp"))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--calibrated", action="store_true", help="also the calibrated w4a16-gguf export as Q4_0")
    a = ap.parse_args()
    if not LLAMA_PY.exists():
        raise SystemExit("no .venv-llama: run `make llama` first (builds llama-cpp-python once, caches the wheel)")
    a.work.mkdir(parents=True, exist_ok=True)
    smol = resolve_model("smollm2-135m").path
    tokens = tokens_of(smol, a.rows, a.seq)
    np.save(a.work / "tokens.npy", tokens)
    prompt_len, new = 32, 32
    ref, _ = simulate(smol, tokens, new, prompt_len)
    tok = AutoTokenizer.from_pretrained(str(smol))

    exports: dict[str, Path] = {}
    seconds: dict[str, float] = {}
    for ftype in ("Q8_0", "Q6_K", "Q4_K_M", "Q4_0"):
        out, t0 = a.work / f"fp8ptq.{ftype}.gguf", time.time()
        convert(ConvertConfig(source=smol, output=out, to="gguf", gguf_type=ftype, overwrite=True))
        exports[f"fp8ptq {ftype}"], seconds[f"fp8ptq {ftype}"] = out, time.time() - t0
    out, t0 = a.work / "fp8ptq.imat.Q4_K_M.gguf", time.time()
    cfg = ConvertConfig(source=smol, output=out, to="gguf", gguf_type="Q4_K_M", importance="builtin", overwrite=True)
    convert(cfg)  # importance: 32 x 512 tokens of the built-in calibration text (not the held-out split scored here)
    exports["fp8ptq Q4_K_M --importance builtin"], seconds["fp8ptq Q4_K_M --importance builtin"] = out, time.time() - t0
    f32 = a.work / "fp8ptq.F32.gguf"
    convert(ConvertConfig(source=smol, output=f32, to="gguf", dtype="float32", overwrite=True))
    exports["F32 (control: llama.cpp's own numerics)"] = f32
    for ftype in ("Q4_K_M", "Q4_0"):
        out, t0 = a.work / f"llama.cpp.{ftype}.gguf", time.time()
        worker("quantize", f32, out, ftype)
        exports[f"llama.cpp {ftype}"], seconds[f"llama.cpp {ftype}"] = out, time.time() - t0
    if a.calibrated:
        from fp8ptq.api import QuantizeConfig, quantize

        ckpt = a.work / "w4a16-gguf"
        quantize(QuantizeConfig(model="smollm2-135m", recipe="w4a16-gguf", output=ckpt, overwrite=True))
        out = a.work / "fp8ptq.w4a16-gguf.Q4_0.gguf"
        convert(ConvertConfig(source=ckpt, output=out, to="gguf", overwrite=True))
        exports["fp8ptq w4a16-gguf (calibrated) Q4_0"] = out

    machine = f"{os.cpu_count()}-core {platform.machine()}"  # relabel with the page's name (M1, M2, ...)
    command = "make llama && .venv/bin/python benchmarks/engines/llamacpp_check.py"
    results = {"version": json.loads(worker("version")), "commit": commit(), "machine": machine, "command": command}
    results |= {"link": None, "rows": a.rows, "seq": a.seq, "exports": {}}  # link: the notebook section
    results["tokenizer"] = tokenizer_agreement(exports["fp8ptq Q4_K_M"], smol, a.work)
    print("tokenizer: llama.cpp == transformers on", results["tokenizer"], flush=True)
    for name, path in exports.items():
        npz = a.work / f"{path.stem}.npz"
        worker("logits", path, a.work / "tokens.npy", npz, prompt_len, new)
        got = np.load(npz)
        eng = torch.log_softmax(torch.from_numpy(got["logits"]).float(), dim=-1)
        sim, greedy_sim = simulate(path, tokens, new, prompt_len)
        greedy = got["greedy"].tolist()
        same = next((i for i, (x, y) in enumerate(zip(greedy, greedy_sim)) if x != y), len(greedy))
        row = compare(ref, sim, eng, tokens)
        row.update(
            mb=path.stat().st_size / 2**20,
            seconds=seconds.get(name),
            greedy_equal_prefix=same,
            greedy_text=tok.decode(greedy),
        )
        results["exports"][name] = row
        print(name, {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    (ROOT / "benchmarks" / "results" / "llamacpp.json").write_text(json.dumps(results, indent=1) + "\n")
    print("\n| export | MB | quant KL | llama.cpp vs simulation: mean abs dlogp / KL / top-1 | greedy equal | text |")
    print("|---|---|---|---|---|---|")
    for name, r in results["exports"].items():
        text = r["greedy_text"].replace("\n", " ").replace("|", "/")[:60]
        print(
            f"| {name} | {r['mb']:.1f} | {r['quant_kl']:.4f} | {r['engine_dlogp']:.4f} / {r['engine_kl']:.4f} / "
            f"{r['engine_top1']:.3f} | {r['greedy_equal_prefix']}/{new} | {text} |"
        )


if __name__ == "__main__":
    sys.exit(main())
