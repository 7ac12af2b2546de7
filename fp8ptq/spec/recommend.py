"""Choose γ from measured acceptance and measured costs; write the engine configs and a plot.

Theory (Leviathan et al.): with per-position acceptance α_1..α_γ (α_i = P(draft i accepted | drafts
<i accepted)), one target forward emits on average τ(γ) = 1 + Σ_{i=1..γ} Π_{j≤i} α_j tokens; with a
single α that is (1 − α^(γ+1)) / (1 − α). A plain decode step costs T_t; a speculative step costs
γ·T_d (draft steps) + T_v(γ+1) (the target verifying γ+1 tokens in one forward), so

    speedup(γ) = τ(γ) · T_t / (γ·T_d + T_v(γ+1))      (= τ / (γ·c + 1) when T_v(γ+1) = T_t, c = T_d/T_t)

Quantized targets and CPUs verify γ+1 tokens at well above the cost of one (SpecMQuant), so T_v is
measured per γ, never assumed. With dynamic draft length (stop drafting when the draft's max
probability < t) each step drafts k ≤ γ tokens; the measured steps give speedup = Σ(n+1)·T_t /
Σ(k·T_d + T_v(k+1)), which is also what this module uses for fixed γ (k = γ every step).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from fp8ptq.spec import SpecError
from fp8ptq.spec.acceptance import Acceptance

MAX_GAMMA = 16
VLLM_SCHEDULE_FIELD = "num_speculative_tokens_per_batch_size"  # vLLM 0.32+: γ per decode batch size


def tau_closed_form(alpha: float, gamma: int) -> float:
    """Expected tokens per target forward for i.i.d. acceptance α: (1 − α^(γ+1)) / (1 − α)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def tau_from_positions(alphas: list[float], gamma: int) -> float:
    """τ(γ) = 1 + Σ_{i≤γ} Π_{j≤i} α_j from per-position conditional acceptance rates."""
    if gamma > len(alphas):
        raise SpecError(
            f"γ={gamma} but acceptance was measured for {len(alphas)} positions",
            fix=f"measure with a larger --max-gamma or recommend γ ≤ {len(alphas)}",
        )
    tau, run = 1.0, 1.0
    for a in alphas[:gamma]:
        run *= a
        tau += run
    return tau


@dataclass(frozen=True)
class Costs:
    """Wall times in seconds. t_verify[k] = one target forward over k new tokens (k = 1 is a plain decode)."""

    t_target: float
    t_draft: float
    t_verify: dict[int, float]
    source: str  # where they were measured, in words

    @property
    def c(self) -> float:
        return self.t_draft / self.t_target

    def verify(self, k: int) -> float:
        if k == 1:
            return self.t_target
        if k in self.t_verify:
            return self.t_verify[k]
        raise SpecError(
            f"no measured verification cost for {k} tokens (have {sorted(self.t_verify)})",
            fix="measure costs for every γ+1 you recommend from",
        )

    def as_dict(self) -> dict:
        return {
            "t_target_s": self.t_target,
            "t_draft_s": self.t_draft,
            "c": self.c,
            "t_verify_s": {str(k): v for k, v in sorted(self.t_verify.items())},
            "verify_over_target": {str(k): v / self.t_target for k, v in sorted(self.t_verify.items())},
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Costs:
        return cls(d["t_target_s"], d["t_draft_s"], {int(k): v for k, v in d["t_verify_s"].items()}, d["source"])


def speedup_from_steps(k_hist: dict[int, int], emitted: int, costs: Costs) -> float:
    """Σ(n+1)·T_t / Σ(k·T_d + T_v(k+1)) over measured steps: k_hist[k] = steps that drafted k tokens,
    emitted = Σ(n+1) tokens those steps produced."""
    cost = sum(count * (k * costs.t_draft + costs.verify(k + 1)) for k, count in k_hist.items())
    return emitted * costs.t_target / cost if cost > 0 else 0.0


def speedup(tau: float, gamma: int, costs: Costs) -> float:
    """Fixed γ: τ·T_t / (γ·T_d + T_v(γ+1))."""
    return tau * costs.t_target / (gamma * costs.t_draft + costs.verify(gamma + 1))


@dataclass(frozen=True)
class Recommendation:
    gamma: int
    tau: float
    speedup: float  # predicted, from the measured τ and costs
    threshold: float | None  # dynamic draft length, when it measured better (not expressible in vLLM 0.32)
    threshold_speedup: float | None
    table: list[dict] = field(default_factory=list)  # per γ: tau, speedup, alpha
    costs: dict = field(default_factory=dict)
    worth_it: bool = True  # False: no γ beats plain decoding under these costs

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RecommendReport(Recommendation):
    """`spec recommend`'s result (spec/run.py): the Recommendation and what came with it; written whole to
    recommendation.json (results.to_json) and returned to the CLI / `quantize --draft`."""

    SCHEMA: ClassVar[str] = "spec-recommend"
    SCHEMA_VERSION: ClassVar[int] = 1

    target: str = ""
    draft: str = ""  # the path written into the configs
    temperature: float = 0.0
    memory_plan: dict | None = None  # memory.MemoryPlan.as_dict() with --device-memory
    threshold_runs: list[dict] = field(default_factory=list)  # acceptance.RunSummary fields + predicted speedup
    engine_check: dict | None = None  # run.engine_check: vLLM vs plain decoding (--engine-check)
    sglang_check: dict | None = None  # SGLang's parser over the flags (--engine-check)
    token_map: str | None = None  # a trimmed draft's map: recorded, not in the SGLang flags
    note: str | None = None
    files: dict[str, str] = field(default_factory=dict)  # vllm, sglang, recommendation, plot -> path
    per_batch: list[dict] = field(default_factory=list)  # schedule.per_batch rows (--batch-sizes)
    batch_schedule: list[list[int]] | None = None  # schedule.vllm_ranges: [start, end, γ] for vLLM


OUTPUT_FILES = {
    "vllm": "speculative_config.json",
    "sglang": "sglang_flags.txt",
    "recommendation": "recommendation.json",
    "plot": "speculative.png",
}


def choose(measured: Acceptance, costs: Costs, gamma_range: tuple[int, int] | None = None) -> Recommendation:
    """Picks the γ with the highest predicted speedup over the measured runs (a dynamic-length threshold
    is reported when one beats it)."""
    runs = [r for r in measured.runs if gamma_range is None or gamma_range[0] <= r.gamma <= gamma_range[1]]
    if not runs:
        raise SpecError(
            f"no measured γ in the range {gamma_range}", fix=f"measured: {[r.gamma for r in measured.runs]}"
        )
    table = []
    for r in sorted(runs, key=lambda r: r.gamma):
        s = speedup_from_steps(r.steps(), r.emitted, costs)
        table.append(
            {
                "gamma": r.gamma,
                "tau": r.tau,
                "alpha": r.alpha,
                "speedup": s,
                "speedup_formula": speedup(r.tau, r.gamma, costs),
            }
        )
    best = max(table, key=lambda t: t["speedup"])
    thr, thr_s = None, None
    for r in measured.threshold_runs:
        s = speedup_from_steps(r.steps(), r.emitted, costs)
        if s > best["speedup"] and (thr_s is None or s > thr_s):
            thr, thr_s = r.threshold, s
    return Recommendation(
        gamma=best["gamma"],
        tau=best["tau"],
        speedup=best["speedup"],
        threshold=thr,
        threshold_speedup=thr_s,
        table=table,
        costs=costs.as_dict(),
        worth_it=best["speedup"] > 1.0,
    )


def vllm_config(draft: str, gamma: int, *, proposer=None) -> dict:
    """The dict vLLM takes as --speculative-config / LLM(speculative_config=...) for DRAFT, written by its
    proposer class's own `vllm_config` (spec/proposers.py). proposer None: the class DRAFT names
    (proposer_class, which reads a head's config.json: a path relative to a bundle passes its class)."""
    from fp8ptq.spec.proposers import proposer_class

    if not 1 <= gamma <= MAX_GAMMA:
        raise SpecError(f"γ={gamma} is out of range", fix=f"use 1..{MAX_GAMMA}")
    return (proposer or proposer_class(draft)).vllm_config(draft, gamma)


def with_schedule(config: dict, ranges: list[list[int]] | None) -> dict:
    """The vLLM speculative config with γ per batch size (spec/schedule.py's ranges) where γ changes with
    the batch; its num_speculative_tokens then the largest γ of the schedule (vLLM caps every range's γ
    by it). One range, or none: the config unchanged (a fixed γ says the same)."""
    top = max((r[2] for r in ranges or ()), default=0)
    if len(ranges or ()) < 2 or top < 1:
        return config
    return {**config, "num_speculative_tokens": top, VLLM_SCHEDULE_FIELD: ranges}


def sglang_flags(draft: str, gamma: int, token_map: str | None = None, *, proposer=None) -> list[str]:
    """SGLang (0.5.23) server flags for DRAFT (its proposer class's own `sglang_flags`; None: the class DRAFT
    names): STANDALONE for a small LLM, EAGLE3 for a head, NGRAM for `ngram[:MIN-MAX]`;
    tests/engine/test_sglang_args.py parses every set with SGLang's own parser.
    No --speculative-token-map (token_map is accepted and left out): SGLang 0.5.23's STANDALONE worker loads
    it but keeps the draft's full LM head and indexes the map with full-vocabulary ids (out of range, or
    wrong tokens), and EAGLE3 reads the head's own d2t. The full draft serves correctly without it."""
    from fp8ptq.spec.proposers import proposer_class

    del token_map
    return (proposer or proposer_class(draft)).sglang_flags(draft, gamma)


def plot(path: Path, rec: Recommendation, title: str) -> Path:
    """PNG of measured τ and predicted speedup against γ."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = [t["gamma"] for t in rec.table]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    ax.plot(g, [t["tau"] for t in rec.table], "o-", color="tab:blue", label="τ (measured tokens / target forward)")
    ax.set_xlabel("γ (drafted tokens per step)")
    ax.set_ylabel("τ", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(g, [t["speedup"] for t in rec.table], "s--", color="tab:red", label="predicted speedup")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax2.set_ylabel("predicted speedup (×)", color="tab:red")
    ax.axvline(rec.gamma, color="tab:green", lw=1, ls=":")
    ax.set_title(f"{title}\nc = {rec.costs['c']:.3f} ({rec.costs['source']}); chosen γ = {rec.gamma}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_outputs(
    out_dir: Path,
    rec: Recommendation,
    *,
    draft: str,
    token_map: str | None = None,
    title: str = "speculative decoding",
    proposer=None,
) -> dict[str, Path]:
    """speculative_config.json (vLLM), sglang_flags.txt, recommendation.json, speculative.png in out_dir
    (OUTPUT_FILES); a RecommendReport is written whole, with its schema keys."""
    from fp8ptq.results import to_json

    out_dir.mkdir(parents=True, exist_ok=True)
    files = {k: out_dir / name for k, name in OUTPUT_FILES.items()}
    config = vllm_config(draft, rec.gamma, proposer=proposer)
    config = with_schedule(config, getattr(rec, "batch_schedule", None))
    files["vllm"].write_text(json.dumps(config, indent=2) + "\n")
    flags = sglang_flags(draft, rec.gamma, token_map, proposer=proposer)
    files["sglang"].write_text(" ".join(flags) + "\n")
    data = to_json(rec) if isinstance(rec, RecommendReport) else rec.as_dict()
    files["recommendation"].write_text(json.dumps(data, indent=2) + "\n")
    plot(files["plot"], rec, title)
    return files
