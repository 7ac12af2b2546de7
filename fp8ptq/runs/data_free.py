"""The data-free path: recipes that need no activation statistics (RTN weights, dynamic activations)
skip calibration. Per decoder layer: read its weights, quantize, write; layer i is written (and
fsynced) in a writer thread while layer i+1 is quantized. Schemes whose handler packs directly (FP8
per-channel / per-tensor) go straight from the source tensors to checkpoint tensors, the same bytes
as the general fp32 fake-quant path that other schemes take."""

from __future__ import annotations

import torch

from fp8ptq.export.writer import BackgroundWrites
from fp8ptq.models.loader import check_finite
from fp8ptq.models.skeleton import build_skeleton
from fp8ptq.quantization.plan import plan_layer
from fp8ptq.quantization.results import LayerResult, QuantizedLinear
from fp8ptq.quantization.schemes import LinearScheme, handler
from fp8ptq.quantization.weights import quantize_group
from fp8ptq.runs.context import RunContext


def data_free_into(ctx: RunContext) -> None:
    """Quantize every layer from ctx.start_layer on into ctx's run directory (rank 0 only)."""
    src, writer = ctx.src, ctx.writer
    layers = src.arch.decoder_layers(build_skeleton(src.config))

    def done(i: int) -> None:
        ctx.run.save_state(layers_done=i + 1, checkpoint=i + 1)
        if ctx.progress:
            ctx.progress("quantize", i + 1, len(layers))

    with BackgroundWrites(writer, done) as writes:  # layer i is written (and fsynced) while i+1 is quantized
        for res in _layers(ctx, layers):
            writes.submit(res)


def _layers(ctx: RunContext, layers):
    """Each decoder layer from the start on, quantized (a LayerResult, not yet written)."""
    src, recipe = ctx.src, ctx.recipe
    arch, w = src.arch, recipe.scheme.weights
    scheme = LinearScheme(w, recipe.scheme.input_activations)
    h = handler(w)
    weight_only = recipe.scheme.input_activations is None
    direct = h.packs_directly(w, recipe.calibration, weight_only)
    for i in range(ctx.start_layer, len(layers)):
        prefix = arch.layer_prefix(i)
        plan = plan_layer(layers[i], prefix, recipe.scheme.targets, recipe.scheme.ignore, arch)
        res = LayerResult(index=i, prefix=prefix, report={"skipped": {prefix + n: why for n, why in plan.skipped}})
        for group in plan.groups:
            if direct:  # the finiteness check rides on the packing pass: NaN / inf weights give non-finite scales
                weights = {n: src.tensor(f"{prefix}{n}.weight") for n in group}
                packed = h.pack(weights, w)
                if not all(bool(torch.isfinite(t["weight_scale"]).all()) for t, _ in packed.values()):
                    for n, t in weights.items():  # raises, naming the first broken tensor of the group
                        check_finite(f"{prefix}{n}.weight", t)
                res.packed.update((prefix + n, p) for n, p in packed.items())
                continue
            weights = {n: check_finite(f"{prefix}{n}.weight", src.tensor(f"{prefix}{n}.weight")) for n in group}
            for n, qw in quantize_group(weights, w, recipe.calibration, None, weight_only).items():
                res.linears[prefix + n] = QuantizedLinear(qw.fake, qw.params, scheme, qw.report)
        yield res
