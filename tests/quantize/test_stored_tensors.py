"""quantize.schemes.stored_tensors: the tensors a compressed Linear stores, asked of compressed-tensors'
compressors (not a copied table) plus the calibrated input scale under its handler's name; `inspect`
checks checkpoints against it and the evaluator and the decompression contract test read by it."""

from __future__ import annotations

import pytest
from compressed_tensors.quantization import QuantizationArgs

from fp8ptq.quantization.schemes import LinearScheme, stored_tensors
from fp8ptq.recipe import builtin_names, load_recipe

pytestmark = pytest.mark.tiny


def _scheme(recipe: str) -> LinearScheme:
    s = load_recipe(recipe).scheme
    acts = s.input_activations
    return LinearScheme(
        QuantizationArgs.model_validate(s.weights.model_dump()),
        None if acts is None else QuantizationArgs.model_validate(acts.model_dump()),
    )


@pytest.mark.parametrize(
    "recipe, fmt, names",
    [
        ("fp8-kv8", "float-quantized", ("weight", "weight_scale", "input_scale")),  # static FP8 inputs
        ("fp8-dynamic", "float-quantized", ("weight", "weight_scale")),
        ("w8a8-int8", "int-quantized", ("weight", "weight_scale")),  # dynamic per-token inputs
        ("flatten-w8a8", "int-quantized", ("weight", "weight_scale", "input_scale")),
        ("w4a16", "pack-quantized", ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")),
        ("w4a16-gguf", "pack-quantized", ("weight_packed", "weight_scale", "weight_shape")),
        ("nvfp4a16", "nvfp4-pack-quantized", ("weight_packed", "weight_scale", "weight_global_scale")),
        (  # dynamic: local inputs: compressed-tensors 0.20 does not list their global scale; the handler does
            "nvfp4",
            "nvfp4-pack-quantized",
            ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
        ),
        ("mxfp4a16", "mxfp4-pack-quantized", ("weight_packed", "weight_scale")),
        ("mxfp8", "mxfp8-quantized", ("weight", "weight_scale")),
    ],
)
def test_stored_tensors_per_recipe(recipe, fmt, names):
    assert stored_tensors(_scheme(recipe), fmt) == names


def test_a_format_compressed_tensors_lacks_is_named():
    with pytest.raises(ValueError, match="no format 'fp3-quantized' .*pack-quantized"):
        stored_tensors(_scheme("fp8-dynamic"), "fp3-quantized")


@pytest.mark.parametrize("recipe", builtin_names())
def test_engine_numerics_are_the_input_handlers(recipe):
    """What vLLM-cpu on AMX applies to a recipe's inputs (engine.vllm.ENGINE_NUMERICS) is said by the
    inputs' scheme handler: block-FP8 runs W8A16, static INT8 inputs are quantized per token at run time,
    everything else as declared (and without engine numerics, always as declared)."""
    from fp8ptq.engine.vllm import ENGINE_NUMERICS
    from fp8ptq.quantization.schemes import handler

    s = _scheme(recipe)
    if s.input_activations is None:
        return
    acts, amx = s.input_activations, handler(s.input_activations)
    assert amx.engine_inputs(s.weights, acts, {}) is acts
    got = amx.engine_inputs(s.weights, acts, ENGINE_NUMERICS["amx_tile"])
    if recipe == "fp8-block":
        assert got is None
    elif acts.type == "int" and not acts.dynamic:
        assert (got.strategy, got.dynamic, got.num_bits) == ("token", True, 8)
    else:
        assert got is acts
