"""Which weights go with which input activations and KV cache: the rules that span two handlers, each
with the engine fact behind it. The recipe layer calls `check_linear_scheme` and turns its ValueError
into a RecipeError naming the recipe."""

from __future__ import annotations

from compressed_tensors.quantization import QuantizationArgs

from fp8ptq.quantization.schemes.base import handler


def is_w4a8_fp8(w: QuantizationArgs, a: QuantizationArgs | None) -> bool:
    """INT4 symmetric group weights with FP8 dynamic per-token inputs: compressed-tensors' W4AFP8 preset,
    vLLM's CompressedTensorsW4A8Fp8 (Hopper)."""
    return (
        a is not None
        and (w.type, w.num_bits, w.strategy, w.symmetric) == ("int", 4, "group", True)
        and (a.type, a.num_bits, a.strategy, a.dynamic) == ("float", 8, "token", True)
    )


def is_mxfp4_fp8(w: QuantizationArgs, a: QuantizationArgs | None) -> bool:
    """MXFP4 weights with dynamic FP8 inputs per token or per group: compressed-tensors' MXFP4XFP8 preset
    (groups of 128), vLLM 0.32's `_is_mxfp4_w4a8_fp8` -> CompressedTensorsW4A8Mxfp4 (Humming's FP8 GEMM
    where installed; without a kernel for FP8 inputs it falls back to the W4A4 path)."""
    return (
        a is not None
        and (w.type, w.num_bits, w.strategy, w.scale_dtype is not None) == ("float", 4, "group", True)
        and (a.type, a.num_bits, a.dynamic, a.scale_dtype) == ("float", 8, True, None)
        and a.strategy in ("token", "group")
    )


def check_linear_scheme(w: QuantizationArgs, a: QuantizationArgs | None, where: str = "") -> None:
    """Weights and input activations of one Linear scheme: each by its handler, then as a pair."""
    pre = f"{where}." if where else ""
    for name, x in ((f"{pre}weights", w), (f"{pre}input_activations", a)):
        if x is not None and x.scale_dtype is not None and (x.type, x.strategy) != ("float", "group"):
            raise ValueError(f"{name}: scale_dtype is only for MX float groups (MXFP4 / MXFP8 weights: uint8)")
    handler(w).check_weights(w, f"{pre}weights")
    if a is not None:
        handler(a).check_inputs(a, f"{pre}input_activations")
        mx_w = w.type == "float" and w.strategy == "group"  # check_weights: MX groups, E8M0 scales
        if (a.scale_dtype is not None and not (mx_w and a.num_bits == w.num_bits)) or (
            mx_w and w.num_bits == 8 and a.scale_dtype is None
        ):
            raise ValueError(
                "MXFP8 goes weights and activations together: MX group weights {num_bits: 8, type: float, "
                "strategy: group, group_size: 32, scale_dtype: uint8} with inputs null (mxfp8a16) or the "
                "same groups dynamic: true (mxfp8); MX inputs of 4 bits go with MXFP4 weights (mxfp4)"
            )
        if mx_w and w.num_bits == 4 and a.scale_dtype is None and not is_mxfp4_fp8(w, a):
            raise ValueError(
                "MXFP4 weights take input_activations null (mxfp4a16), dynamic MXFP4 groups of 32 (mxfp4) "
                "or dynamic FP8 {type: float, num_bits: 8, strategy: token or group, dynamic: true} "
                "(mxfp4-fp8: vLLM's CompressedTensorsW4A8Mxfp4)"
            )
        if is_w4a8_fp8(w, a) or (w.type, w.num_bits, a.type) == ("float", 4, "float"):
            pass  # W4A8-FP8; NVFP4 W4A4 (fp4 check_inputs), MXFP4 with MXFP4 or FP8 inputs (above)
        elif w.num_bits == 4:
            raise ValueError(
                "4-bit weights are exported weight-only (W4A16: input_activations null) or as W4A8-FP8 "
                "(symmetric INT4 groups + {type: float, strategy: token, dynamic: true} inputs)"
            )
        elif a.type != w.type:
            raise ValueError(
                f"weights are {w.type} but input_activations {a.type}: vLLM runs W8A8 as FP8xFP8 or INT8xINT8 GEMMs"
            )
    _check_block_pairing(w, a)


def _check_block_pairing(w: QuantizationArgs, a: QuantizationArgs | None) -> None:
    """Block weights run in vLLM only with dynamic per-token-group inputs of the block's width
    (CompressedTensorsW8A8Fp8 asserts a non-static input scheme and quantizes activations in groups of
    block_structure[0]); group-wise inputs only with block weights, MX weights with MX inputs, or MXFP4
    weights with FP8 inputs."""
    if w.strategy == "block":
        b = w.block_structure[0]
        if a is None or a.strategy != "group" or a.group_size != b:
            raise ValueError(
                f"block_structure {list(w.block_structure)} weights need input_activations "
                f"{{type: float, strategy: group, group_size: {b}, dynamic: true}} (vLLM quantizes "
                "block-FP8 inputs per token-group of the block width)"
            )
    elif a is not None and a.strategy == "group" and a.scale_dtype is None and not is_mxfp4_fp8(w, a):
        raise ValueError(
            "group-wise input activations go with block weights (strategy: block, block_structure) or MXFP4 "
            "weights (mxfp4-fp8)"
        )
