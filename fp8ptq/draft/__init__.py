"""Making a draft for speculative decoding: `train` (a small causal-LM draft distilled on the target's own
generations), `trim` (VocabTrim: the draft's vocabulary cut to the target's most used tokens),
`eagle3_train` and `eagle3_warm` (an EAGLE-3 head on the target's hidden states), `loop` (the one
training loop both trainers run: AdamW, schedule, time budget, resumable checkpoints), `auto` (the
bundle `quantize --draft` writes: draft, measurement, recommendation).

This package uses `fp8ptq/spec/` (the models, loops, sampling and measurement a draft is judged by);
`spec/` never imports it (tests/test_house.py's layers), so using a draft does not depend on making one.
"""
