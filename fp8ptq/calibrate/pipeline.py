"""Sequential calibration and quantization, one decoder layer at a time.

For each layer: load its weights, run it ONCE over the whole calibration batch with hooks on every
targeted Linear. A hook sees the complete input of its fused group (which already comes from the
quantized upstream: earlier layers and earlier sublayers of this one), chooses the input scale,
quantizes the group's weights (RTN or GPTQ with the Hessian of the inputs the engine will see), and
returns the quantized input. The attention hook does the same for post-RoPE keys and values. So one
forward per layer calibrates everything with exact sequential semantics, and the layer's output is
the next layer's input. Memory: one layer + the calibration activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fp8ptq.calibrate.observers import OBSERVERS
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import build_skeleton, decoder_layers, materialize, release
from fp8ptq.ops.fp8 import choose_fp8_scale, fake_quant_fp8, scale_from_amax
from fp8ptq.ops.gptq import accumulate_hessian, gptq_quantize
from fp8ptq.ops.granularity import CHANNEL, TENSOR, reduce_amax
from fp8ptq.quantize.numerics import input_quantizer, quantize_input_static, register_attention
from fp8ptq.quantize.plan import LayerPlan, granularity, plan_layer
from fp8ptq.recipe import Recipe

Progress = Callable[[str, int, int], None]


@dataclass
class QuantizedLinear:
    """One Linear's result: fake-quant weight (fp32, on the FP8 grid) and its scales."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    report: dict


@dataclass
class LayerResult:
    index: int
    prefix: str
    linears: dict[str, QuantizedLinear] = field(default_factory=dict)  # full module name -> result
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # full tensor name -> scale
    report: dict = field(default_factory=dict)


def quantize_weights(weights: dict[str, torch.Tensor], recipe: Recipe, H: torch.Tensor | None):
    """Quantize one fused group's weights onto the FP8 grid. Returns {name: (w_fake, scale, report)}.

    Per-tensor scales are shared by the group (vLLM requantizes fused shards to the max scale anyway;
    sharing up front avoids that second rounding). GPTQ needs H; RTN ignores it.
    """
    g = granularity(recipe.scheme.weights)
    cal = recipe.calibration
    if g == TENSOR:
        shared = scale_from_amax(torch.stack([reduce_amax(w, TENSOR) for w in weights.values()]).amax().reshape(1))
    out = {}
    for name, w in weights.items():
        w = w.float()
        scale = shared if g == TENSOR else choose_fp8_scale(w, CHANNEL)
        if cal.weight_method == "gptq":
            col_scale = scale.reshape(-1, 1)
            q = gptq_quantize(
                w, H, lambda col, _j: fake_quant_fp8(col.unsqueeze(1), col_scale, g)[:, 0],
                block_size=cal.gptq_block_size, damp=cal.gptq_damp, act_order=cal.gptq_act_order,
            )
        else:
            q = fake_quant_fp8(w, scale, g)
        report = {"weight_rel_err": float((q - w).norm() / w.norm().clamp_min(1e-12))}
        if H is not None:
            d = q - w  # relative output error on the calibration inputs: tr(D H D^T) / tr(W H W^T)
            report["output_rel_err"] = float(((d @ H) * d).sum().clamp_min(0).sqrt() / ((w @ H) * w).sum().clamp_min(1e-12).sqrt())
        out[name] = (q, scale, report)
    return out


class _LayerCalibrator:
    """Hooks on one layer that calibrate-and-quantize during a single forward over all samples."""

    def __init__(self, layer: torch.nn.Module, plan: LayerPlan, recipe: Recipe, result: LayerResult):
        self.layer, self.plan, self.recipe, self.result = layer, plan, recipe, result
        self.modules = dict(layer.named_modules())
        self.quant_of: dict[tuple, Callable] = {}
        self.choice: dict[tuple, object] = {}  # group -> ScaleChoice of its static input scale
        self.done: dict[tuple, bool] = {}
        self._last: tuple | None = None  # (input, quantized input): q/k/v see the same tensor
        self.handles = [
            self.modules[n].register_forward_pre_hook(self._make_hook(group)) for group in plan.groups for n in group
        ]
        self.attn = [m for n, m in layer.named_modules() if n.endswith("self_attn")]
        if recipe.scheme.kv_cache is not None:
            for attn in self.attn:
                attn.fp8ptq_kv_hook = self._kv

    def _make_hook(self, group):
        def hook(_module, args):
            x = args[0]
            if self._last is None or self._last[0] is not x:
                self._last = None  # drop the previous pair before allocating the next
                if group not in self.quant_of:
                    self.quant_of[group] = self._input_quantizer(group, x)
                self._last = (x, self.quant_of[group](x))
            if not self.done.get(group):
                self._quantize_weights(group, x, self._last[1])
                self.done[group] = True
            return (self._last[1], *args[1:])

        return hook

    def _input_quantizer(self, group, x) -> Callable:
        acts = self.recipe.scheme.input_activations
        if acts is None:
            return lambda t: t  # weight-only
        if acts.dynamic:
            return input_quantizer(True, None)
        choice = OBSERVERS[self.recipe.calibration.observer](x)
        self.choice[group] = choice
        return input_quantizer(False, choice.scale)

    def _quantize_weights(self, group, x, xq):
        H = None
        if self.recipe.calibration.weight_method == "gptq":
            H, _ = accumulate_hessian(None, xq if self.recipe.calibration.gptq_quantized_inputs else x, 0)
        choice = self.choice.get(group)
        weights = {n: self.modules[n].weight.data for n in group}
        for name, (q, scale, report) in quantize_weights(weights, self.recipe, H).items():
            self.modules[name].weight.data = q
            if choice is not None:
                report.update(input_amax=choice.amax, input_clip_ratio=choice.clip_ratio)
            self.result.linears[self.plan.prefix + name] = QuantizedLinear(
                q, scale, None if choice is None else choice.scale, report
            )

    def _kv(self, attn, k, v):
        observe = OBSERVERS[self.recipe.calibration.observer]
        prefix = self.plan.prefix + [n for n, m in self.layer.named_modules() if m is attn][0]
        kc, vc = observe(k), observe(v)
        self.result.kv_scales[f"{prefix}.k_scale"] = kc.scale
        self.result.kv_scales[f"{prefix}.v_scale"] = vc.scale
        self.result.report.setdefault("kv", {}).update(k_amax=kc.amax, v_amax=vc.amax)
        return quantize_input_static(k, kc.scale), quantize_input_static(v, vc.scale)

    def close(self):
        for h in self.handles:
            h.remove()
        for attn in self.attn:
            attn.__dict__.pop("fp8ptq_kv_hook", None)


def calibrate(
    src: ModelSource,
    recipe: Recipe,
    input_ids: torch.Tensor,
    on_layer: Callable[[LayerResult], None],
    progress: Progress | None = None,
    device: str = "cpu",
) -> None:
    """Run sequential calibration; `on_layer` receives each finished layer (then the layer is freed)."""
    model = build_skeleton(src.config, attn_implementation=register_attention())
    embed = model.model.embed_tokens
    materialize(embed, "model.embed_tokens.", src, torch.float32, device)
    with torch.inference_mode():
        hidden = embed(input_ids.to(device))
    release(embed)
    position_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0)
    rotary = model.model.rotary_emb.to(device)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}."
        materialize(layer, prefix, src, torch.float32, device)
        plan = plan_layer(layer, prefix, recipe.scheme.targets, recipe.scheme.ignore)
        result = LayerResult(index=i, prefix=prefix)
        result.report["skipped"] = {prefix + n: why for n, why in plan.skipped}
        calibrator = _LayerCalibrator(layer, plan, recipe, result)
        try:
            with torch.inference_mode():
                pos = rotary(hidden, position_ids)
                out = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=pos)
                hidden = out[0] if isinstance(out, tuple) else out
        finally:
            calibrator.close()
        on_layer(result)
        release(layer)
        if progress:
            progress("calibrate", i + 1, len(layers))
