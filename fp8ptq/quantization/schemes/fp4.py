"""FP4 E2M1 (`fp4`): NVFP4 weights, groups of 16 with FP8 E4M3 group scales and a per-tensor fp32 global
scale (compressed-tensors `strategy: tensor_group, group_size: 16`, format `nvfp4-pack-quantized`:
`weight_packed` uint8 [out, in / 2], `weight_scale` FP8 [out, in / 16], `weight_global_scale` fp32
[1]). Weight-only (NVFP4A16) or W4A4 with NVFP4 inputs: a calibrated per-tensor global scale
(`input_global_scale`, the divisor) and dynamic FP8 group scales (`dynamic: local`). Conventions in
ops/fp4.py; the weight global scale is taken over the stacked shards of a fused group, so q/k/v and
gate/up share it (vLLM 0.32 takes the max of the shards'), as do their input scales.

MXFP4 (OCP Microscaling, compressed-tensors' `MXFP4A16`, `MXFP4` and `MXFP4XFP8` presets): weights
`strategy: group, group_size: 32, scale_dtype: uint8`, format `mxfp4-pack-quantized`: `weight_packed` as
NVFP4's, `weight_scale` uint8 [out, in / 32] holding E8M0 exponents (scale 2^(e - 127)), no global scale.
Inputs unquantized (A16), dynamic MXFP4 groups of 32 (W4A4, `fake_quant_mxfp4_act`: vLLM's own rule) or
dynamic FP8 (the FP8 handler's; the pairing rule is in pairing.py). vLLM 0.32 reads all three as MXFP4
weights (CompressedTensorsW4A4Mxfp4 / W4A8Mxfp4) and runs the inputs its kernel has: MXFP4 on Blackwell
(FlashInfer), FP8 through Humming where installed, else bf16 through Marlin (weight-only)."""

from __future__ import annotations

import torch

from fp8ptq.ops.fp4 import MX_GROUP, NVFP4_GROUP, fake_quant_mxfp4_act, mxfp4_grid, nvfp4_global_scale, nvfp4_grid
from fp8ptq.ops.grid import NVFP4_ACT_GRID
from fp8ptq.quantization.schemes.base import SchemeHandler, register


@register
class FP4(SchemeHandler):
    key = "fp4"

    def check_weights(self, args, where):
        nvfp4 = (args.strategy, args.group_size, args.symmetric, args.dynamic) == ("tensor_group", 16, True, False)
        mx = (args.strategy, args.group_size, args.symmetric, args.dynamic) == ("group", MX_GROUP, True, False)
        if mx and args.scale_dtype != torch.uint8:
            raise ValueError(
                f"{where}: MXFP4 weights need scale_dtype: uint8 (E8M0 power-of-two scales, compressed-tensors' "
                f"MXFP4A16 preset), got {args.scale_dtype}"
            )
        if nvfp4 and args.scale_dtype not in (None, torch.float8_e4m3fn):
            raise ValueError(f"{where}: NVFP4 group scales are float8_e4m3fn, got scale_dtype {args.scale_dtype}")
        if not (nvfp4 or mx):
            raise ValueError(
                f"{where}: 4-bit float weights are NVFP4: {{num_bits: 4, type: float, strategy: tensor_group, "
                f"group_size: {NVFP4_GROUP}, symmetric: true, dynamic: false}} or MXFP4: {{..., strategy: group, "
                f"group_size: {MX_GROUP}, scale_dtype: uint8}}"
            )

    def check_inputs(self, args, where):
        nvfp4 = (args.strategy, args.group_size, args.symmetric, str(args.dynamic)) == (
            "tensor_group",
            16,
            True,
            "local",
        )
        mx = (args.strategy, args.group_size, args.symmetric, args.dynamic, args.scale_dtype) == (
            "group",
            MX_GROUP,
            True,
            True,
            torch.uint8,
        )
        if not (nvfp4 or mx):
            raise ValueError(
                f"{where}: 4-bit float activations are NVFP4: {{num_bits: 4, type: float, strategy: tensor_group, "
                f"group_size: {NVFP4_GROUP}, symmetric: true, dynamic: local}} (a calibrated global scale, "
                f"dynamic group scales) or MXFP4: {{..., strategy: group, group_size: {MX_GROUP}, scale_dtype: "
                "uint8, dynamic: true}"
            )

    def dynamic(self, args):
        return fake_quant_mxfp4_act  # check_inputs admits no other dynamic FP4 inputs

    def act_grid(self, args):
        return NVFP4_ACT_GRID

    def input_scale_tensors(self, scale):
        """compressed-tensors stores the divisor 1 / scale as `input_global_scale` (exact: scale is a power of two)."""
        return {"input_global_scale": (1.0 / scale.float()).reshape(1)}

    def weight_grid(self, args, cal, global_scale=None, weight_only=False):
        mse, hessian = cal.weight_search
        if args.strategy == "group":  # MXFP4: `weight_observer: mse` picks each group's exponent by error
            return mxfp4_grid(mse=mse, hessian=hessian)
        assert global_scale is not None, "NVFP4 grids need the weight's global scale"
        return nvfp4_grid(global_scale, mse=mse, hessian=hessian)

    def global_scale(self, args, w):
        return nvfp4_global_scale(w) if args.strategy == "tensor_group" else None

    def format(self, weights, acts):
        return "mxfp4-pack-quantized" if weights.strategy == "group" else "nvfp4-pack-quantized"

    def fixed_group_size(self, args):
        return args.group_size  # NVFP4 16, MXFP4 32 (check_weights accepts no other)

    def vllm_cpu_refusal(self, weights, acts):
        if weights.strategy == "group":
            return "MXFP4 runs on CUDA (capability >= 8.0), ROCm and XPU only; vLLM 0.32 lists no CPU MXFP4 kernel"
        return (
            "NVFP4 runs on CUDA GPUs only (vLLM 0.32: Blackwell natively, capability >= 7.5 through Marlin for "
            "weight-only); vLLM-cpu has no NVFP4 kernel"
        )
