"""Measure speculative decoding with real models: acceptance per draft position, τ per γ, and costs.

The loop is real speculative decoding (batch 1, KV caches on both models): the draft proposes up to γ
tokens autoregressively, the target scores the last emitted token + the drafts in ONE forward, and
`sampling.verify` / `verify_greedy` decide. Greedy output therefore equals the target's greedy output.

Counting follows vLLM's spec-decode counters so the two can be compared on the same prompts and γ:
per step ("draft"), drafted += γ (k when the dynamic threshold stopped early), accepted += n (length
of the accepted prefix), per_pos[i] += 1 for i < n. Generation ignores EOS and stops at max_tokens,
like fp8ptq's vLLM worker (ignore_eos=True); the first token comes from the target's prefill.
τ = emitted tokens / target forwards in the speculative phase = mean (n + 1).

Costs (`measure_costs`): median wall time of a draft step (1 token), a target step over 1 token and over
k = 2..γ+1 tokens, each with a KV cache holding `context` tokens, on the models as loaded here (the
target under simulated numerics in fp32: it is what this harness runs, not the engine's kernels; see
docs/speculative.md for costs measured in vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp8ptq.spec import SpecError
from fp8ptq.spec.acceptance import Acceptance, RunSummary, bootstrap_taus
from fp8ptq.spec.models import LoadedModel, crop, new_cache, step_logits
from fp8ptq.spec.proposers import proposer_for
from fp8ptq.spec.recommend import Costs
from fp8ptq.spec.sampling import verify_drafts
from fp8ptq.spec.steps import median_time, pick_token, prefilled_cache, probe_ids, timed_step

__all__ = ["SpecStats", "speculative_generate", "plain_generate", "measure_acceptance", "replay_greedy"]
__all__ += ["measure_costs", "pick_token", "median_time"]


@dataclass(frozen=True)
class Decoding:
    """How speculative_generate decodes one prompt."""

    gamma: int  # draft tokens per step at most
    max_tokens: int
    temperature: float = 0.0
    threshold: float | None = None  # dynamic draft length: stop drafting when the draft's max p (T = 1) < t
    device: str = "cpu"


@dataclass(frozen=True)
class AcceptancePlan:
    """What measure_acceptance runs: every γ, and each dynamic-length threshold at threshold_gamma."""

    gammas: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    thresholds: tuple[float, ...] = ()
    threshold_gamma: int | None = None  # None: the largest γ
    seed: int = 0
    device: str = "cpu"


@dataclass
class SpecStats:
    gamma: int
    drafts: int = 0  # verification steps with at least one drafted token
    drafted: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)  # accepted count per draft position
    reached: list[int] = field(default_factory=list)  # drafts that proposed a token at position i
    emitted: int = 0  # tokens emitted by verification steps (excludes the prefill token)
    target_forwards: int = 0
    k_hist: dict[int, int] = field(default_factory=dict)
    prompts: list[tuple[int, int]] = field(default_factory=list)  # (emitted, target_forwards) per ended prompt

    def __post_init__(self):
        self.per_pos = self.per_pos or [0] * self.gamma
        self.reached = self.reached or [0] * self.gamma

    def add(self, k: int, n: int) -> None:
        self.target_forwards += 1
        self.emitted += n + 1
        self.k_hist[k] = self.k_hist.get(k, 0) + 1
        if k == 0:
            return
        self.drafts += 1
        self.drafted += k
        self.accepted += n
        for i in range(k):
            self.reached[i] += 1
        for i in range(n):
            self.per_pos[i] += 1

    def end_prompt(self) -> None:
        """Close one prompt's counts (its share of emitted tokens and forwards: tau_se's bootstrap unit)."""
        done = [sum(x) for x in zip(*self.prompts)] if self.prompts else [0, 0]
        self.prompts.append((self.emitted - done[0], self.target_forwards - done[1]))

    def tau_se(self, resamples: int = 2000) -> float | None:
        """τ's standard error over prompts: the std of τ = Σ emitted / Σ forwards over prompt resamples
        drawn with replacement (fixed seed, so a measurement's number is reproducible)."""
        if len(self.prompts) < 2:
            return None
        return float(bootstrap_taus([self.prompts], resamples)[0].std())

    def summary(self, threshold: float | None = None) -> RunSummary:
        alphas = [a / r if r else 0.0 for a, r in zip(self.per_pos, self.reached)]
        # accepted at i over accepted at i - 1 (drafts cut short by max_tokens make this a slight underestimate)
        cond = alphas[:1] + [a / b if b else 0.0 for a, b in zip(self.per_pos[1:], self.per_pos[:-1])]
        return RunSummary(
            gamma=self.gamma,
            drafts=self.drafts,
            drafted=self.drafted,
            accepted=self.accepted,
            per_pos_accepted=list(self.per_pos),
            per_pos_reached=list(self.reached),
            alpha_per_pos=alphas,
            alpha=self.accepted / self.drafted if self.drafted else 0.0,
            tau=self.emitted / self.target_forwards if self.target_forwards else 1.0,
            emitted=self.emitted,
            target_forwards=self.target_forwards,
            k_hist={str(k): v for k, v in sorted(self.k_hist.items())},
            threshold=threshold,
            tau_se=self.tau_se(),
            alpha_conditional=cond,
            per_prompt=[list(x) for x in self.prompts],
        )


def _target_pass(target: LoadedModel, ids: list[int], cache, cap, device: str):
    """The target over `ids` after its cache: logits [len(ids), V] and, when a proposer reads them (cap: its
    Proposer.capture), its hidden rows [len(ids), ...] (EAGLE-3: its aux layers; MTP: after the final norm)."""
    logits = step_logits(target, ids, cache, device)
    return logits, None if cap is None else cap.take()[0]


def speculative_generate(
    target: LoadedModel,
    draft,
    prompt: list[int],
    how: Decoding,
    *,
    generator: torch.Generator | None = None,
    stats: SpecStats | None = None,
) -> list[int]:
    """Generate how.max_tokens tokens after `prompt` by speculative decoding with any proposer (`draft`: a
    draft model, an n-gram proposer or an EAGLE-3 head; proposers.py); updates `stats` per step."""
    temperature, device = how.temperature, how.device
    g = generator or torch.Generator().manual_seed(0)
    prop = proposer_for(draft)
    tc = new_cache(target.model)
    with prop.capture(target.model) as cap:
        logits, aux = _target_pass(target, prompt, tc, cap, device)
        first, _ = pick_token(logits[-1], temperature, g)
        seq = list(prompt) + [first]  # the target cache holds len(seq) - 1 positions at each step start
        prop.begin(target.vocab_size, aux, device)
        while len(seq) - len(prompt) < how.max_tokens:
            base = len(seq)
            drafted, q_rows = prop.propose(seq, gamma=how.gamma, temperature=temperature, threshold=how.threshold, g=g)
            k = len(drafted)
            t_logits, t_aux = _target_pass(target, [seq[-1]] + drafted, tc, cap, device)  # [k+1, V]: p_1..p_{k+1}
            n, new = verify_drafts(t_logits, drafted, q_rows, temperature, g)
            if stats is not None:
                stats.add(k, n)
            seq.extend(new)
            crop(tc, base + n)  # drop the rejected drafts' positions; the newest token is fed next step
            prop.verified(base, n, t_aux)
    return seq[len(prompt) :][: how.max_tokens]


@torch.inference_mode()
def plain_generate(
    target: LoadedModel,
    prompt: list[int],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    device: str = "cpu",
) -> list[int]:
    """The baseline the speedup is relative to: one target forward per token, same cache and sampling code."""
    g = generator or torch.Generator().manual_seed(0)
    cache = new_cache(target.model)
    tok, _ = pick_token(step_logits(target, prompt, cache, device)[-1], temperature, g)
    out = [tok]
    while len(out) < max_tokens:
        tok, _ = pick_token(step_logits(target, [tok], cache, device)[-1], temperature, g)
        out.append(tok)
    return out


def measure_acceptance(
    target: LoadedModel, draft, prompts: list[list[int]], plan: AcceptancePlan, progress=None
) -> tuple[Acceptance, dict[int, list[list[int]]]]:
    """Run the speculative loop on every prompt for each γ (and each dynamic-length threshold at
    threshold_gamma, default max γ). Returns the counters (a RunSummary per γ and per threshold) and
    the outputs, γ -> token ids per prompt. progress(stage, done, total) is called per prompt."""
    gammas, thresholds, temperature, max_tokens = plan.gammas, plan.thresholds, plan.temperature, plan.max_tokens
    prop = proposer_for(draft)
    prop.check(target)
    if thresholds and not prop.has_probabilities:
        raise SpecError(
            "dynamic draft length (--thresholds) needs a draft model's probabilities",
            fix="drop --thresholds for an n-gram proposer",
        )
    jobs = [(g, None) for g in gammas] + [(plan.threshold_gamma or max(gammas), t) for t in thresholds]
    total = len(jobs) * len(prompts)
    runs, thr_runs, outputs = [], [], {}
    done = 0
    for gamma, thr in jobs:
        stats = SpecStats(gamma)
        outs = []
        for i, ids in enumerate(prompts):
            g = torch.Generator().manual_seed(plan.seed * 1_000_003 + i)
            outs.append(
                speculative_generate(
                    target,
                    draft,
                    ids,
                    Decoding(gamma, max_tokens, temperature, thr, plan.device),
                    generator=g,
                    stats=stats,
                )
            )
            stats.end_prompt()
            done += 1
            if progress:
                progress("measure", done, total)
        if thr is None:
            runs.append(stats.summary())
            outputs[gamma] = outs
        else:
            thr_runs.append(stats.summary(thr))
    acceptance = Acceptance(tuple(runs), tuple(thr_runs), temperature, max_tokens, len(prompts), plan.seed)
    return acceptance, outputs


@torch.inference_mode()
def replay_greedy(
    draft,
    prompt: list[int],
    stream: list[int],
    *,
    gamma: int,
    stats: SpecStats,
    max_tokens: int | None = None,
    target: LoadedModel | None = None,
    device: str = "cpu",
) -> None:
    """Greedy acceptance of `draft` against a fixed continuation `stream` of `prompt`: the steps and counting
    of speculative_generate at temperature 0 with the target's argmax replaced by the stream. Given the
    greedy output of an engine (vLLM), this is what the engine's own spec-decode counters must show, with
    no difference between the engine's target numerics and fp8ptq's simulation entering the comparison
    (a single flipped argmax changes the rest of a greedy continuation). Generation stops at max_tokens
    (default len(stream)); a longer stream lets the last step verify past it, as a real target does.
    `target`: for a proposer that reads the target's hidden states (EAGLE-3, MTP), taken from one forward of
    it over prompt + stream."""
    prop = proposer_for(draft)
    if prop.reads_target and target is None:
        raise SpecError(f"replaying a {prop.method} proposer needs its target", fix="pass target=")
    prop.begin_replay(target, prompt, stream, device)
    seq = list(prompt) + [stream[0]]
    while len(seq) - len(prompt) < (max_tokens or len(stream)):
        base = len(seq)
        drafted, _ = prop.propose(seq, gamma=gamma, temperature=0.0, threshold=None, g=None)
        truth = stream[base - len(prompt) :]  # what the target emits at the k + 1 verified positions
        n = 0
        while n < min(len(drafted), len(truth)) and drafted[n] == truth[n]:
            n += 1
        stats.add(len(drafted), n)
        seq.extend(truth[: n + 1])
        prop.verified(base, n, None)


@torch.inference_mode()
def measure_costs(
    target: LoadedModel,
    draft,
    context: list[int],
    *,
    max_k: int,
    repeats: int = 7,
    device: str = "cpu",
    progress=None,
    batch: int = 1,
) -> Costs:
    """Median wall time of: one draft step (1 token), a target forward over k = 1..max_k tokens, each
    after a KV cache of len(context) tokens (rolled back after every timed call); `batch` sequences at
    once (every row the same context: the cost of a decode batch of that size)."""
    n = len(context)
    tc = prefilled_cache(target, context, device, batch)
    probe = probe_ids(context, max_k)
    t_draft = proposer_for(draft).step_time(target, context, max_k=max_k, repeats=repeats, device=device, batch=batch)
    t_verify = {}
    for k in range(1, max_k + 1):
        t_verify[k] = median_time(timed_step(target, tc, probe[:k], n, device, batch), repeats)
        if progress:
            progress("costs" if batch == 1 else f"costs, batch {batch}", k, max_k)
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    rows = "" if batch == 1 else f", batch {batch}"
    where = f"HF {device}, {dtype}, {torch.get_num_threads()} thread(s), context {n}{rows}, median of {repeats}"
    return Costs(t_target=t_verify[1], t_draft=t_draft, t_verify=t_verify, source=where)
