"""Proposers: what drafts tokens for the one speculative loop (`measure.py`), keyed by vLLM's
`speculative_config.method`.

A proposer follows one sequence: `begin` (the target's prefill done; `aux` holds the target's hidden
rows of the prompt when the proposer reads them), then per step `propose` (up to γ tokens after seq,
with q rows over the target vocabulary, None when greedy) and `verified` (the target accepted n of
them at base = len(seq) before the step; `aux` holds its rows of the k + 1 verified positions). The
loop, the greedy replay against a fixed stream and the cost measurement are written once over this
interface (`proposer_base.py`); a new proposer is one class here and one line in PROPOSERS.

    draft_model   a small causal LM (draft-train), full or VocabTrim vocabulary, with its own KV cache
    ngram         vLLM's prompt-lookup proposer: no model, one-hot q
    suffix        vLLM's suffix decoding (arctic-inference's suffix trees, `suffix.py`): no model, one-hot q
    eagle3        an EAGLE-3 head on the target's residual stream at its aux layers (`eagle3_loop.py`)
    mtp           the target's own multi-token-prediction layer on its final hidden states (`mtp.py`)
"""

from __future__ import annotations

import torch

from fp8ptq.spec import SpecError
from fp8ptq.spec.eagle3_loop import AuxCapture, HeadState, head_step_time
from fp8ptq.spec.eagle3_loop import propose as head_propose
from fp8ptq.spec.models import crop, new_cache, parse_ngram, step_logits, to_target_probs
from fp8ptq.spec.mtp import MtpProposer
from fp8ptq.spec.proposer_base import Proposer, TargetHiddenProposer, one_hot_rows
from fp8ptq.spec.sampling import probs as to_probs
from fp8ptq.spec.steps import median_time, pick_token, prefilled_cache, probe_ids, timed_step
from fp8ptq.spec.suffix import is_suffix, parse_suffix


class DraftModelProposer(Proposer):
    method = "draft_model"
    sglang_algorithm = "STANDALONE"  # a small LLM as the draft

    @classmethod
    def claims(cls, draft) -> bool:
        return True  # any other path: asked last

    @property
    def vocab_trimmed(self):
        return self.draft.kept_ids is not None

    def begin(self, vocab, aux, device):
        self.vocab, self.device = vocab, device
        self.cache, self.held, self.filled = new_cache(self.draft.model), 0, 0

    def _next(self, logits, temperature, g):
        """A draft token in target ids, and q over the target vocabulary (None when greedy)."""
        d = self.draft
        if d.kept_ids is None:
            return pick_token(logits, temperature, g)
        if temperature == 0:
            return int(d.kept_ids[int(logits.argmax())]), None
        q = to_target_probs(d, to_probs(logits, temperature), self.vocab)
        return int(torch.multinomial(q.cpu(), 1, generator=g)), q

    def propose(self, seq, *, gamma, temperature, threshold, g):
        drafted, q_rows = [], []
        feed, self.filled = seq[self.held :], self.held
        for _ in range(gamma):
            logits = step_logits(self.draft, feed, self.cache, self.device)[-1]
            self.filled += len(feed)
            if threshold is not None and float(torch.softmax(logits, -1).max()) < threshold:
                break
            tok, q = self._next(logits, temperature, g)
            drafted.append(tok)
            q_rows.append(q)
            feed = [tok]
        return drafted, q_rows

    def verified(self, base, n, aux):
        self.held = min(self.filled, base + n)  # positions of seq the draft cache holds
        crop(self.cache, self.held)

    def step_time(self, target, context, *, max_k, repeats, device, batch=1):
        cache = prefilled_cache(self.draft, context, device, batch)
        probe = probe_ids(context, max_k)[:1]
        return median_time(timed_step(self.draft, cache, probe, len(context), device, batch), repeats)


class NgramProposer(Proposer):
    method = "ngram"
    has_probabilities = False
    model_free = True

    @classmethod
    def claims(cls, draft) -> bool:
        return parse_ngram(draft) is not None

    @classmethod
    def vllm_config(cls, draft, gamma):
        """Both prompt-lookup sizes explicit (`ngram[:MIN-MAX]`, default 2-4)."""
        ngram = parse_ngram(draft)
        return {
            "method": "ngram",
            "num_speculative_tokens": gamma,
            "prompt_lookup_min": ngram.nmin,
            "prompt_lookup_max": ngram.nmax,
        }

    @classmethod
    def sglang_flags(cls, draft, gamma):
        """SGLang's NGRAM algorithm (CUDA only), one branch (BFS breadth 1), its trie deep enough for the
        longest match plus the γ drafted tokens. Its matcher is a trie of earlier n-grams (the deepest
        matching suffix wins; there is no minimum match length), not vLLM's prompt lookup, so the measured τ
        is vLLM's. SGLang 0.5.23 refuses the older `--speculative-ngram-{min,max}-match-window-size`."""
        ngram = parse_ngram(draft)
        return [
            "--speculative-algorithm",
            "NGRAM",
            "--speculative-num-draft-tokens",
            str(gamma + 1),
            "--speculative-ngram-max-trie-depth",
            str(ngram.nmax + gamma),
            "--speculative-ngram-match-type",
            "BFS",
            "--speculative-ngram-min-bfs-breadth",
            "1",
            "--speculative-ngram-max-bfs-breadth",
            "1",
        ]

    def check(self, target):
        pass  # it copies the target's own ids

    def begin(self, vocab, aux, device):
        self.vocab = vocab

    def propose(self, seq, *, gamma, temperature, threshold, g):
        drafted = self.draft.propose(seq, gamma)
        return drafted, one_hot_rows(drafted, temperature, self.vocab)

    def verified(self, base, n, aux):
        pass

    def step_time(self, target, context, *, max_k, repeats, device, batch=1):
        # one proposal of max_k - 1 tokens: the whole draft phase of a step; per-request host work, done
        # for each of `batch` sequences in turn
        return batch * median_time(lambda: self.draft.propose(context, max_k - 1), repeats) / max(1, max_k - 1)


class Eagle3Proposer(TargetHiddenProposer):
    method = "eagle3"
    sglang_algorithm = "EAGLE3"  # the head's d2t maps its draft vocabulary: no token map

    @classmethod
    def claims(cls, draft) -> bool:
        from fp8ptq.spec.eagle3 import is_eagle3

        return is_eagle3(draft)  # its config.json's architecture

    @classmethod
    def load(cls, draft, target=None, device="cpu"):
        from fp8ptq.spec.eagle3 import load_head
        from fp8ptq.spec.eagle3_loop import Eagle3Draft

        if target is None:
            raise SpecError(
                f"the EAGLE-3 head '{draft}' runs on its target's hidden states", fix="load the target first"
            )
        return Eagle3Draft(load_head(draft, target.model, device), str(draft))

    @property
    def layer_ids(self):
        return tuple(self.draft.head.s.layer_ids)

    def capture(self, model):
        return AuxCapture(model, self.layer_ids)

    def new_state(self):
        return HeadState(self.draft.head)

    def propose(self, seq, *, gamma, temperature, threshold, g):
        return head_propose(
            self.draft, self.state, seq, self.rows(seq), gamma=gamma, temperature=temperature, g=g, threshold=threshold
        )

    def step_time(self, target, context, *, max_k, repeats, device, batch=1):
        return head_step_time(target, self.draft, context, repeats, device, batch)


class SuffixProposer(Proposer):
    """vLLM's `method: suffix`: each sequence is one request of the draft's SuffixDecodingCache, fed and
    asked as vLLM's SuffixDecodingProposer feeds and asks it (suffix.py); drafts of any length up to γ."""

    method = "suffix"
    has_probabilities = False

    @classmethod
    def claims(cls, draft) -> bool:
        return is_suffix(draft)

    model_free = True

    @classmethod
    def load(cls, draft, target=None, device="cpu"):
        return parse_suffix(draft)

    @classmethod
    def vllm_config(cls, draft, gamma):
        """γ is vLLM's cap on each draft; the cached-request count explicit (`suffix[:N]`)."""
        d = parse_suffix(draft)
        return {
            "method": "suffix",
            "num_speculative_tokens": gamma,
            "suffix_decoding_max_cached_requests": d.max_cached_requests,
        }

    @classmethod
    def sglang_flags(cls, draft, gamma):
        """SGLang 0.5.23 has no suffix decoding (its algorithms: EAGLE, EAGLE3, STANDALONE, NGRAM, ...): no
        flags, so SGLang serves without speculation."""
        return []

    def check(self, target):
        pass  # it copies the target's own ids

    def begin(self, vocab, aux, device):
        self.vocab, self.rid, self.fed = vocab, None, 0

    def propose(self, seq, *, gamma, temperature, threshold, g):
        d = self.draft
        if self.rid is None:  # the first step after the prefill: seq = prompt + the first sampled token
            self.rid, self.fed = d.start(seq[:-1]), len(seq) - 1
        d.add(self.rid, seq[self.fed :])  # the tokens sampled since the last step
        self.fed = len(seq)
        drafted = d.propose(self.rid, seq, gamma)
        return drafted, one_hot_rows(drafted, temperature, self.vocab)

    def verified(self, base, n, aux):
        pass

    def step_time(self, target, context, *, max_k, repeats, device, batch=1):
        d = parse_suffix(f"suffix:{self.draft.max_cached_requests}")
        rid = d.start(context[:-1])
        d.add(rid, context[-1:])
        # per-request host work, done for each of `batch` sequences in turn
        return batch * median_time(lambda: d.propose(rid, context, max_k - 1), repeats) / max(1, max_k - 1)


# In the order `proposer_class` asks them: the draft model, which claims any path, last
PROPOSERS: dict[str, type[Proposer]] = {
    p.method: p for p in (NgramProposer, SuffixProposer, MtpProposer, Eagle3Proposer, DraftModelProposer)
}


def proposer_for(draft) -> Proposer:
    """The proposer of a loaded draft (its `method`: LoadedModel draft_model, NgramDraft, Eagle3Draft)."""
    return PROPOSERS[draft.method](draft)


def proposer_class(draft: str) -> type[Proposer]:
    """The proposer a DRAFT argument names, without loading it: the first in PROPOSERS that claims it."""
    return next(p for p in PROPOSERS.values() if p.claims(draft))
