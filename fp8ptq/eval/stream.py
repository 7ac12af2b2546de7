"""Quality metrics computed one decoder layer at a time, like calibration: memory flat in depth.

Two residual streams (reference and candidate) for every evaluation sample live in activation stores
(calibrate/store.py). Each decoder layer of the reference is materialized, run over all samples and
released; then the same layer of the candidate, built exactly as `quality.load_simulated` builds it
(weights dequantized by compressed-tensors, input and KV quantizers installed: `quality.SimLoader`).
At the end the final norms and LM heads turn both streams into logits a window of tokens at a time,
giving what `quality.compare` gives on the whole models (same numbers to float-summation order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from fp8ptq.calibrate.store import ActivationStore
from fp8ptq.errors import ModelError
from fp8ptq.eval.quality import SimLoader
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import build_skeleton, release
from fp8ptq.quantize.numerics import register_attention

CHUNK_TOKENS = 4096  # tokens per pass of a layer (whole samples)
HEAD_BYTES = 16 << 20  # fp32 logits of one side per window of tokens at the end (~6 such temporaries live)


@dataclass
class _Side:
    """One model of the comparison: its loader, its weightless skeleton and its residual stream."""

    loader: SimLoader
    model: torch.nn.Module
    inputs: Callable
    store: ActivationStore

    @property
    def src(self) -> ModelSource:
        return self.loader.src

    def load(self, module: torch.nn.Module, prefix: str, device) -> list:
        """Fill `module` (named `prefix`) with its simulated fp32 tensors; returns input-quantizer handles."""
        state, input_quant = self.loader.state(module, prefix)
        module.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
        missing = [n for n, p in module.named_parameters() if p.is_meta]
        assert not missing, f"parameters not loaded under {prefix}: {missing[:5]}"
        self.src.close()  # drop mmaps: touched file pages would otherwise stay in RSS, growing with depth
        return self.loader.install(module, input_quant)


def _open(src: ModelSource, ids: torch.Tensor, device, simulate: bool, engine: dict | None) -> _Side:
    loader = SimLoader(src, simulate=simulate, engine=engine)
    model = build_skeleton(src.config, attn_implementation=register_attention())
    arch = src.arch
    inputs = arch.layer_inputs(model, ids.shape[1], device)
    store = ActivationStore(ids.shape[0], ids.shape[1], src.text_config.hidden_size)
    # Rows looked up in the stored dtype and widened (the values load_simulated's fp32 table gives).
    table = src.tensor(f"{arch.embed}.weight")
    scale = arch.embed_scale(model.config) if arch.embed_scale else None
    for i in range(ids.shape[0]):
        x = F.embedding(ids[i : i + 1], table).float()
        store.write(i, x if scale is None else x * torch.tensor(scale))
    del table
    src.close()
    return _Side(loader, model, inputs, store)


def _run_layer(side: _Side, index: int, device, step: int) -> None:
    arch = side.src.arch
    layer = arch.decoder_layers(side.model)[index]
    arch.check_layer(layer, index)
    handles = side.load(layer, arch.layer_prefix(index), device)
    side.loader.install_kv(layer, index)
    inputs = side.inputs(index)
    try:
        with torch.inference_mode():
            for s in range(0, side.store.shape[0], step):
                x = side.store.read(s, min(s + step, side.store.shape[0]), copy=False).to(device)  # rows written after
                for block in arch.blocks:
                    x = arch.run_block(layer, block, x, inputs)
                side.store.write(s, x)
    finally:
        for h in handles:
            h.remove()
        attn = arch.attention_of(layer)
        if attn is not None:
            for hook in ("fp8ptq_kv_hook", "fp8ptq_query_hook"):
                layer.get_submodule(attn).__dict__.pop(hook, None)
        release(layer)


def _head(side: _Side, device) -> Callable[[torch.Tensor], torch.Tensor]:
    """hidden states -> log-probabilities: the model's final norm, LM head (and Gemma's logit soft-cap)."""
    model = side.model
    norm_name = side.src.arch.final_norm
    norm = model.get_submodule(norm_name)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    side.load(norm, norm_name + ".", device)
    side.load(head, head_name + ".", device)  # a quantized head keeps its input quantizer installed
    cap = getattr(model.config, "final_logit_softcapping", None)

    def fn(x: torch.Tensor) -> torch.Tensor:
        logits = head(norm(x)).float()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return F.log_softmax(logits, dim=-1)

    return fn


@torch.inference_mode()
def compare_streaming(
    reference: ModelSource,
    candidate: ModelSource,
    input_ids: torch.Tensor,
    *,
    device: str = "cpu",
    simulate_reference: bool = False,
    simulate: bool = True,
    engine: dict | None = None,
    progress=None,
) -> tuple[dict, dict]:
    """quality.compare(load_simulated(reference), load_simulated(candidate), input_ids), layer by layer.

    Returns (metrics, the candidate's numerics as load_simulated reports them). progress: optional
    callback (stage, done, total) per decoder layer."""
    sides = [
        _open(reference, input_ids, device, simulate_reference, None),
        _open(candidate, input_ids, device, simulate, engine),
    ]
    n, seq = input_ids.shape
    layers = [len(s.src.arch.decoder_layers(s.model)) for s in sides]
    if layers[0] != layers[1]:
        raise ModelError(
            f"the candidate has {layers[1]} decoder layers and the reference {layers[0]}",
            fix="compare a checkpoint with the model it was made from",
        )
    step = max(1, CHUNK_TOKENS // seq)
    try:
        for i in range(layers[0]):
            for side in sides:
                _run_layer(side, i, device, step)
            if progress:
                progress("evaluate", i + 1, layers[0])
        heads = [_head(s, device) for s in sides]
        vocab = max(s.model.config.get_text_config().vocab_size for s in sides)
        window = max(1, HEAD_BYTES // (4 * vocab))
        nll_ref = nll_cand = kl = agree = 0.0
        for s in range(n):
            xs = [side.store.read(s, s + 1, copy=False).to(device) for side in sides]  # read only
            for a in range(0, seq - 1, window):
                b = min(a + window, seq - 1)
                lr, lc = (h(x[:, a:b]) for h, x in zip(heads, xs))
                target = input_ids[s : s + 1, a + 1 : b + 1].to(device).unsqueeze(-1)
                nll_ref -= float(lr.gather(-1, target).sum())
                nll_cand -= float(lc.gather(-1, target).sum())
                kl += float((lr.exp() * (lr - lc)).sum())
                agree += float((lr.argmax(-1) == lc.argmax(-1)).sum())
    finally:
        for side in sides:
            side.store.close()
    tokens = n * (seq - 1)
    metrics = {
        "tokens": tokens,
        "ppl_reference": math.exp(nll_ref / tokens),
        "ppl": math.exp(nll_cand / tokens),
        "kl": kl / tokens,
        "top1": agree / tokens,
    }
    return metrics, sides[1].loader.numerics
