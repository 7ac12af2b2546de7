"""FP4 E2M1 (`fp4`): NVFP4 weights, groups of 16 with FP8 E4M3 group scales and a per-tensor fp32 global
scale (compressed-tensors `strategy: tensor_group, group_size: 16`, format `nvfp4-pack-quantized`:
`weight_packed` uint8 [out, in / 2], `weight_scale` FP8 [out, in / 16], `weight_global_scale` fp32
[1]). Weight-only (NVFP4A16). Conventions in ops/fp4.py; the global scale is taken over the stacked
shards of a fused group, so q/k/v and gate/up share it (vLLM 0.32 takes the max of the shards')."""

from __future__ import annotations

from fp8ptq.ops.fp4 import NVFP4_GROUP, nvfp4_global_scale
from fp8ptq.ops.gptq import nvfp4_grid
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

    def weight_grid(self, args, cal, global_scale=None):
        assert global_scale is not None, "NVFP4 grids need the weight's global scale"
        return nvfp4_grid(global_scale)

    def global_scale(self, args, w):
        return nvfp4_global_scale(w)

    def format(self, weights, acts):
        return "nvfp4-pack-quantized"
