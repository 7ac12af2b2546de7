"""FP4 E2M1 (`fp4`): NVFP4 weights, groups of 16 with FP8 E4M3 group scales and a per-tensor fp32 global
scale (compressed-tensors `strategy: tensor_group, group_size: 16`, format `nvfp4-pack-quantized`:
`weight_packed` uint8 [out, in / 2], `weight_scale` FP8 [out, in / 16], `weight_global_scale` fp32
[1]). Weight-only (NVFP4A16) or W4A4 with NVFP4 inputs: a calibrated per-tensor global scale
(`input_global_scale`, the divisor) and dynamic FP8 group scales (`dynamic: local`). Conventions in
ops/fp4.py; the weight global scale is taken over the stacked shards of a fused group, so q/k/v and
gate/up share it (vLLM 0.32 takes the max of the shards'), as do their input scales."""

from __future__ import annotations

from fp8ptq.ops.fp4 import NVFP4_GROUP, nvfp4_global_scale
from fp8ptq.ops.gptq import nvfp4_grid
from fp8ptq.ops.grid import NVFP4_ACT_GRID
from fp8ptq.quantize.schemes.base import SchemeHandler, register


@register
class FP4(SchemeHandler):
    key = "fp4"

    def check_weights(self, args, where):
        nvfp4 = (args.strategy, args.group_size, args.symmetric, args.dynamic) == ("tensor_group", 16, True, False)
        if not nvfp4:
            raise ValueError(
                f"{where}: 4-bit float weights are NVFP4: {{num_bits: 4, type: float, strategy: tensor_group, "
                f"group_size: {NVFP4_GROUP}, symmetric: true, dynamic: false}}"
            )

    def check_inputs(self, args, where):
        nvfp4 = (args.strategy, args.group_size, args.symmetric, str(args.dynamic)) == (
            "tensor_group",
            16,
            True,
            "local",
        )
        if not nvfp4:
            raise ValueError(
                f"{where}: 4-bit float activations are NVFP4: {{num_bits: 4, type: float, strategy: tensor_group, "
                f"group_size: {NVFP4_GROUP}, symmetric: true, dynamic: local}} (a calibrated global scale, "
                "dynamic group scales)"
            )

    def act_grid(self, args):
        return NVFP4_ACT_GRID

    def input_scale_tensors(self, scale):
        """compressed-tensors stores the divisor 1 / scale as `input_global_scale` (exact: scale is a power of two)."""
        return {"input_global_scale": (1.0 / scale.float()).reshape(1)}

    def weight_grid(self, args, cal, global_scale=None):
        assert global_scale is not None, "NVFP4 grids need the weight's global scale"
        return nvfp4_grid(global_scale)

    def global_scale(self, args, w):
        return nvfp4_global_scale(w)

    def format(self, weights, acts):
        return "nvfp4-pack-quantized"
