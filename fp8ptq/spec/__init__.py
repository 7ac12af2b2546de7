"""Speculative decoding: exact sampling, draft training and trimming, measurement, recommendation.

Layout (imports flow down the list): `sampling` (pure functions over probabilities), `memory` and
`recommend` (pure arithmetic + output files), `prompts` (built-in prompt sets), `models` (HF draft /
target loading and KV-cache helpers), `eagle3` (EAGLE-3 head: module, vLLM layout) and `eagle3_loop` (the
head's speculative loop on the target's hidden states), `measure` (the speculative loop with HF models),
`draft_train`, `draft_trim`, `eagle3_train`, `auto` (the bundle `quantize --draft auto` writes).
"""

from fp8ptq.errors import Fp8ptqError


class SpecError(Fp8ptqError):
    """A draft, target or speculative-decoding setting that cannot be used (names the value and the fix)."""
