"""Speculative decoding, using a draft: exact sampling, the speculative loops, measurement, recommendation.
Making a draft (training, vocabulary trimming, the `quantize --draft` bundle) is `fp8ptq/draft/`, a layer
above: it uses this package, this package never imports it (tests/test_house.py).

Layout (imports flow down the list): `sampling` (pure functions over probabilities), `memory` and
`recommend` (pure arithmetic + output files), `prompts` (built-in prompt sets), `models` (HF draft /
target loading and KV-cache helpers), `eagle3` (EAGLE-3 head: module, vLLM layout) and `eagle3_loop` (the
head's speculative loop on the target's hidden states), `measure` (the speculative loop with HF models),
`run` (`fp8ptq spec`: measure, plan, engine check).
"""

from fp8ptq.errors import Fp8ptqError


class SpecError(Fp8ptqError):
    """A draft, target or speculative-decoding setting that cannot be used (names the value and the fix)."""
