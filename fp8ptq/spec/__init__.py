"""Speculative decoding, using a draft: exact sampling, the speculative loops, measurement, recommendation.
Making a draft (training, vocabulary trimming, the `quantize --draft` bundle) is `fp8ptq/draft/`, a layer
above: it uses this package, this package never imports it (tests/test_house.py).

Layout (imports flow down the list): `sampling` (pure functions over probabilities), `memory` and
`recommend` (pure arithmetic + output files), `prompts` (built-in prompt sets), `models` (HF draft /
target loading and KV-cache helpers), `eagle3` (EAGLE-3 head: module, vLLM layout) and `eagle3_loop` (the
head's math on the target's hidden states), `steps` (next token, step timing), `proposers` (draft model,
n-gram, EAGLE-3 behind one interface, keyed by vLLM's method), `measure` (the one speculative loop,
replay and cost measurement over any proposer), `run` (`fp8ptq spec`: measure, plan, engine check).
"""

from fp8ptq.errors import Fp8ptqError


class SpecError(Fp8ptqError):
    """A draft, target or speculative-decoding setting that cannot be used (names the value and the fix)."""
