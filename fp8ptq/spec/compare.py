"""`fp8ptq spec compare TARGET DRAFT [DRAFT ...]`: every proposer measured on the same target and prompts,
each recommended (its γ, its configs: `spec recommend` into OUT/<n>-<method>/), and one decision: which to
serve and why. The decision is the highest speedup — vLLM's measured one where `--engine-check` ran every
proposer, else the one predicted from measured τ and costs — and "no speculation" where none beats plain
decoding. The winner's speculative_config.json and sglang_flags.txt are copied to OUT itself, so
`vllm serve TARGET --speculative-config "$(cat OUT/speculative_config.json)"` serves the decision.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from fp8ptq.spec import SpecError


@dataclass(frozen=True)
class CompareReport:
    """`spec compare`'s result; OUT/comparison.json (results.to_json)."""

    SCHEMA: ClassVar[str] = "spec-compare"
    SCHEMA_VERSION: ClassVar[int] = 1

    target: str
    basis: str  # "vllm" (every engine check ran) or "predicted"
    chosen: str | None  # the draft to serve; None: serve without speculation
    why: str
    proposers: list[dict] = field(default_factory=list)  # per draft: method, gamma, tau, alpha, c, speedups, folder


def compare(target: str, drafts: list[str], output: Path, recommend_config, *, overwrite: bool = False, progress=None):
    """recommend_config(draft, folder) -> the RecommendConfig of one proposer (spec/run.py); each writes its
    own folder inside the output, which is made atomically."""
    from fp8ptq.io import atomic_output_dir
    from fp8ptq.results import to_json
    from fp8ptq.spec.proposers import proposer_class
    from fp8ptq.spec.run import recommend

    if len(drafts) < 2 or len(set(drafts)) != len(drafts):
        raise SpecError(
            f"spec compare needs two or more different drafts (got {drafts})", fix="e.g. DRAFT ngram suffix"
        )
    rows, recs = [], {}
    with atomic_output_dir(Path(output), overwrite, inputs=(target, *drafts)) as tmp:
        for i, draft in enumerate(drafts):
            method = proposer_class(draft).method
            folder = f"{i}-{method}"
            rec = recommend(dataclasses.replace(recommend_config(draft, tmp / folder), overwrite=False), progress)
            recs[draft] = (rec, folder)
            run = next(t for t in rec.table if t["gamma"] == rec.gamma)
            e = rec.engine_check or {}
            rows.append(
                {
                    "draft": draft,
                    "method": method,
                    "folder": folder,
                    "gamma": rec.gamma,
                    "tau": rec.tau,
                    "alpha": run["alpha"],
                    "c": rec.costs.get("c"),
                    "predicted_speedup": rec.speedup,
                    "vllm_speedup": e.get("speedup") if e.get("ok") else None,
                    "vllm_acceptance": (e.get("vllm") or {}).get("acceptance") if e.get("ok") else None,
                }
            )
        checked = all(r["vllm_speedup"] is not None for r in rows)
        key = "vllm_speedup" if checked else "predicted_speedup"
        best = max(rows, key=lambda r: r[key])
        ranked = ", ".join(f"{r['draft']} {r[key]:.2f}×" for r in sorted(rows, key=lambda r: -r[key]))
        basis = "vLLM's measured tokens/s" if checked else "the speedup predicted from measured τ and costs"
        if best[key] > 1.0:
            chosen = best["draft"]
            why = (
                f"{best['draft']} ({best['method']}, γ {best['gamma']}, τ {best['tau']:.2f}, α {best['alpha']:.3f}) "
                f"is fastest by {basis}: {ranked}"
            )
            for name in ("speculative_config.json", "sglang_flags.txt"):
                shutil.copy(tmp / best["folder"] / name, tmp / name)
        else:
            chosen = None
            why = f"no proposer beats plain decoding by {basis} ({ranked}): serve without speculation"
        report = CompareReport(
            target=str(target), basis="vllm" if checked else "predicted", chosen=chosen, why=why, proposers=rows
        )
        (tmp / "comparison.json").write_text(json.dumps(to_json(report), indent=2) + "\n")
    return report
