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

import statistics
import time
from dataclasses import dataclass, field

import torch

from fp8ptq.spec import SpecError
from fp8ptq.spec.models import (
    LoadedModel,
    NgramDraft,
    check_pair,
    crop,
    draft_cache,
    new_cache,
    step_logits,
    to_target_probs,
)
from fp8ptq.spec.recommend import Costs
from fp8ptq.spec.sampling import probs as to_probs
from fp8ptq.spec.sampling import verify_drafts


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

    def summary(self) -> dict:
        alphas = [a / r if r else 0.0 for a, r in zip(self.per_pos, self.reached)]
        return {
            "gamma": self.gamma,
            "drafts": self.drafts,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "per_pos_accepted": self.per_pos,
            "per_pos_reached": self.reached,
            "alpha_per_pos": alphas,
            "alpha": self.accepted / self.drafted if self.drafted else 0.0,
            "tau": self.emitted / self.target_forwards if self.target_forwards else 1.0,
            "emitted": self.emitted,
            "target_forwards": self.target_forwards,
            "k_hist": {str(k): v for k, v in sorted(self.k_hist.items())},
        }


def pick_token(logits: torch.Tensor, temperature: float, g: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """The next token: argmax at temperature 0, else a sample from the tempered distribution (also returned)."""
    if temperature == 0:
        return int(logits.argmax()), None
    p = to_probs(logits, temperature)
    return int(torch.multinomial(p.cpu(), 1, generator=g)), p


def _draft_next(
    draft: LoadedModel, logits: torch.Tensor, temperature: float, V: int, g: torch.Generator
) -> tuple[int, torch.Tensor | None]:
    """A draft token in target ids, and q over the target vocabulary (None when greedy)."""
    if draft.kept_ids is None:
        return pick_token(logits, temperature, g)
    if temperature == 0:
        return int(draft.kept_ids[int(logits.argmax())]), None
    q = to_target_probs(draft, to_probs(logits, temperature), V)
    return int(torch.multinomial(q.cpu(), 1, generator=g)), q


def _propose(
    draft: LoadedModel | NgramDraft,
    seq: list[int],
    dlen: int,
    dc,
    *,
    gamma: int,
    temperature: float,
    threshold: float | None,
    V: int,
    g: torch.Generator | None,
    device: str,
):
    """Up to γ draft tokens after seq (the draft cache holds dlen positions): (tokens, q rows, cache length).
    The n-gram proposer drafts 0..γ tokens from seq itself; its q rows are one-hot (None when greedy)."""
    if isinstance(draft, NgramDraft):
        drafted = draft.propose(seq, gamma)
        q_rows = [
            None if temperature == 0 else torch.nn.functional.one_hot(torch.tensor(t), V).double() for t in drafted
        ]
        return drafted, q_rows, len(seq)
    drafted, q_rows = [], []
    feed, dcache = seq[dlen:], dlen
    for _ in range(gamma):
        logits = step_logits(draft, feed, dc, device)[-1]
        dcache += len(feed)
        if threshold is not None and float(torch.softmax(logits, -1).max()) < threshold:
            break
        tok, q = _draft_next(draft, logits, temperature, V, g)
        drafted.append(tok)
        q_rows.append(q)
        feed = [tok]
    return drafted, q_rows, dcache


def speculative_generate(
    target: LoadedModel,
    draft: LoadedModel | NgramDraft,
    prompt: list[int],
    *,
    gamma: int,
    max_tokens: int,
    temperature: float = 0.0,
    threshold: float | None = None,
    generator: torch.Generator | None = None,
    stats: SpecStats | None = None,
    device: str = "cpu",
) -> list[int]:
    """Generate max_tokens tokens after `prompt` by speculative decoding; updates `stats` per step.

    threshold: dynamic draft length — stop drafting when the draft's max probability (at T = 1) < t."""
    g = generator or torch.Generator().manual_seed(0)
    V = target.vocab_size
    tc, dc = new_cache(target.model), draft_cache(draft)
    first, _ = pick_token(step_logits(target, prompt, tc, device)[-1], temperature, g)
    seq = list(prompt) + [first]  # the target cache holds len(seq) - 1 positions at each step start
    dlen = 0  # positions of seq the draft cache holds
    while len(seq) - len(prompt) < max_tokens:
        base = len(seq)
        drafted, q_rows, dcache = _propose(
            draft, seq, dlen, dc, gamma=gamma, temperature=temperature, threshold=threshold, V=V, g=g, device=device
        )
        k = len(drafted)
        t_logits = step_logits(target, [seq[-1]] + drafted, tc, device)  # [k+1, V]: p_1..p_{k+1}
        n, new = verify_drafts(t_logits, drafted, q_rows, temperature, g)
        if stats is not None:
            stats.add(k, n)
        seq.extend(new)
        crop(tc, base + n)  # drop the rejected drafts' positions; the newest token is fed next step
        dlen = min(dcache, base + n)
        crop(dc, dlen)
    return seq[len(prompt) :][:max_tokens]


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


def _generate_for(draft):
    """The speculative loop for this kind of draft: an EAGLE-3 head reads the target's hidden states."""
    if getattr(draft, "head", None) is not None:
        from fp8ptq.spec.eagle3_loop import eagle3_generate

        return eagle3_generate
    return speculative_generate


def measure_acceptance(
    target: LoadedModel,
    draft: LoadedModel | NgramDraft,
    prompts: list[list[int]],
    *,
    gammas: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    thresholds: list[float] = (),
    threshold_gamma: int | None = None,
    seed: int = 0,
    device: str = "cpu",
    progress=None,
) -> dict:
    """Run the speculative loop on every prompt for each γ (and each dynamic-length threshold at
    threshold_gamma, default max γ). Returns {'runs': [summary per γ], 'threshold_runs': [...],
    'outputs': {γ: token ids per prompt}, ...}. progress(stage, done, total) is called per prompt."""
    check_pair(target, draft)
    if thresholds and isinstance(draft, NgramDraft):
        raise SpecError(
            "dynamic draft length (--thresholds) needs a draft model's probabilities",
            fix="drop --thresholds for an n-gram proposer",
        )
    jobs = [(g, None) for g in gammas] + [(threshold_gamma or max(gammas), t) for t in thresholds]
    total = len(jobs) * len(prompts)
    runs, thr_runs, outputs = [], [], {}
    done = 0
    for gamma, thr in jobs:
        stats = SpecStats(gamma)
        outs = []
        for i, ids in enumerate(prompts):
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            outs.append(
                _generate_for(draft)(
                    target,
                    draft,
                    ids,
                    gamma=gamma,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    threshold=thr,
                    generator=g,
                    stats=stats,
                    device=device,
                )
            )
            done += 1
            if progress:
                progress("measure", done, total)
        summary = stats.summary()
        if thr is None:
            runs.append(summary)
            outputs[gamma] = outs
        else:
            thr_runs.append({**summary, "threshold": thr})
    return {
        "runs": runs,
        "threshold_runs": thr_runs,
        "outputs": outputs,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "prompts": len(prompts),
        "seed": seed,
    }


@torch.inference_mode()
def replay_greedy(
    draft: LoadedModel | NgramDraft,
    prompt: list[int],
    stream: list[int],
    *,
    gamma: int,
    stats: SpecStats,
    max_tokens: int | None = None,
    device: str = "cpu",
) -> None:
    """Greedy acceptance of `draft` against a fixed continuation `stream` of `prompt`: the steps and counting
    of speculative_generate at temperature 0 with the target's argmax replaced by the stream. Given the
    greedy output of an engine (vLLM), this is what the engine's own spec-decode counters must show, with
    no difference between the engine's target numerics and fp8ptq's simulation entering the comparison
    (a single flipped argmax changes the rest of a greedy continuation). Generation stops at max_tokens
    (default len(stream)); a longer stream lets the last step verify past it, as a real target does."""
    dc = draft_cache(draft)
    seq, dlen = list(prompt) + [stream[0]], 0
    while len(seq) - len(prompt) < (max_tokens or len(stream)):
        base = len(seq)
        drafted, _, dcache = _propose(
            draft, seq, dlen, dc, gamma=gamma, temperature=0.0, threshold=None, V=0, g=None, device=device
        )
        truth = stream[base - len(prompt) :]  # what the target emits at the k + 1 verified positions
        n = 0
        while n < min(len(drafted), len(truth)) and drafted[n] == truth[n]:
            n += 1
        stats.add(len(drafted), n)
        seq.extend(truth[: n + 1])
        dlen = min(dcache, base + n)
        crop(dc, dlen)


def median_time(fn, repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls, after one warm-up call."""
    fn()  # warm-up: allocator, lazy init
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(
    target: LoadedModel,
    draft: LoadedModel | NgramDraft,
    context: list[int],
    *,
    max_k: int,
    repeats: int = 7,
    device: str = "cpu",
    progress=None,
) -> Costs:
    """Median wall time of: one draft step (1 token), a target forward over k = 1..max_k tokens, each
    after a KV cache of len(context) tokens (rolled back after every timed call)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    tc = new_cache(target.model)
    step_logits(target, context, tc, device)
    n = len(context)
    probe = context[-max_k:] if len(context) >= max_k else (context * max_k)[:max_k]

    def run(m, cache, ids):
        def f():
            step_logits(m, ids, cache, device)
            sync()
            crop(cache, n)

        return f

    if getattr(draft, "head", None) is not None:  # an EAGLE-3 head: one head step over its own KV cache
        from fp8ptq.spec.eagle3_loop import head_step_time

        t_draft = head_step_time(target, draft, context, repeats, device)
    elif isinstance(draft, NgramDraft):  # one proposal of max_k - 1 tokens: the whole draft phase of a step
        t_draft = median_time(lambda: draft.propose(context, max_k - 1), repeats) / max(1, max_k - 1)
    else:
        dc = new_cache(draft.model)
        step_logits(draft, context, dc, device)
        t_draft = median_time(run(draft, dc, probe[:1]), repeats)
    t_verify = {}
    for k in range(1, max_k + 1):
        t_verify[k] = median_time(run(target, tc, probe[:k]), repeats)
        if progress:
            progress("costs", k, max_k)
    dtype = str(next(target.model.parameters()).dtype).replace("torch.", "")
    where = f"HF {device}, {dtype}, {torch.get_num_threads()} thread(s), context {n}, median of {repeats}"
    return Costs(t_target=t_verify[1], t_draft=t_draft, t_verify=t_verify, source=where)
