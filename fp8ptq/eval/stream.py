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
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from fp8ptq.calibrate.store import ActivationStore
from fp8ptq.errors import ModelError
from fp8ptq.eval.quality import SimLoader
from fp8ptq.models.arch.tokens import reads_tokens, sample_inputs
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import build_skeleton, release
from fp8ptq.quantization.numerics import clear_kv_hook, register_attention

CHUNK_TOKENS = 4096  # tokens per pass of a layer (whole samples)
# The LM heads run on windows of HEAD_MATMUL_BYTES of fp32 logits per side: a 262k-token head read once per
# 16 tokens made the head's weight traffic, not its arithmetic, the cost of the whole check. The softmax,
# KL and agreement then run on slices of HEAD_BYTES, which stay in cache (~6 such temporaries live).
HEAD_MATMUL_BYTES = 256 << 20
HEAD_BYTES = 16 << 20


@dataclass
class _Side:
    """One model of the comparison: its loader, its weightless skeleton and its residual stream."""

    loader: SimLoader
    model: torch.nn.Module
    inputs: Callable
    store: ActivationStore
    own: dict = field(default_factory=dict)  # sample -> its layers' own arguments (models/arch/tokens.py)

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
    store = ActivationStore(ids.shape[0], ids.shape[1], arch.stream_width(model))
    if reads_tokens(arch):  # the stack's own forward gives each sample its first-layer input and arguments
        own = {}
        for i, x, args in sample_inputs(arch, model, src, ids, inputs, samples=range(ids.shape[0]), device=device):
            store.write(i, x.cpu())
            own[i] = args.__getitem__
        return _Side(loader, model, inputs, store, own)
    # Rows looked up in the stored dtype and widened (the values load_simulated's fp32 table gives).
    table = src.tensor(f"{arch.embed}.weight")
    scale = arch.embed_scale(model.config) if arch.embed_scale else None
    for i in range(ids.shape[0]):
        x = F.embedding(ids[i : i + 1], table).float()
        store.write(i, arch.enter(model, x if scale is None else x * torch.tensor(scale)))
    del table
    src.close()
    return _Side(loader, model, inputs, store)


def _run_layer(side: _Side, index: int, device, step: int) -> None:
    arch = side.src.arch
    layer = arch.decoder_layers(side.model)[index]
    arch.check_layer(layer, index)
    handles = side.load(layer, arch.layer_prefix(index), device)
    side.loader.install_kv(layer, index)
    step = 1 if side.own else step  # samples with their own arguments run one at a time
    try:
        with torch.inference_mode():
            for s in range(0, side.store.shape[0], step):
                x = side.store.read(s, min(s + step, side.store.shape[0]), copy=False).to(device)  # rows written after
                inputs = side.own[s](index) if side.own else side.inputs(index)
                for block in arch.blocks:
                    x = arch.run_block(layer, block, x, inputs)
                side.store.write(s, x)
    finally:
        for h in handles:
            h.remove()
        attn = arch.attention_of(layer)
        if attn is not None:
            clear_kv_hook(layer.get_submodule(attn))
            layer.get_submodule(attn).__dict__.pop("fp8ptq_query_hook", None)
        release(layer)


def _head(side: _Side, device) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(hidden states [1, t, hidden], a buffer [1, >= t, vocab]) -> logits in the buffer's first t rows: the
    model's final norm, LM head (a quantized head's input quantizer included) and Gemma's logit soft-cap.
    Writing into one buffer per side keeps the allocator from mapping fresh pages for every window."""
    model = side.model
    norm_name = side.src.arch.final_norm
    norm = model.get_submodule(norm_name)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    side.load(norm, norm_name + ".", device)
    arch = side.src.arch
    for name in arch.stack_modules(model):  # what runs between the last layer and the norm (streams.py)
        side.load(model.get_submodule(name), name + ".", device)
    state, input_quant = side.loader.state(head, head_name + ".")
    head.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    side.src.close()
    quant = input_quant.get("") if side.loader.simulate else None
    weight, bias = head.weight, head.bias
    cap = getattr(model.config, "final_logit_softcapping", None)

    def fn(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        y = norm(arch.leave(model, x))
        if quant is not None:
            y = quant(y)
        out = buf[:, : x.shape[1]]
        torch.matmul(y, weight.t(), out=out)
        if bias is not None:
            out += bias
        if cap is not None:
            out.div_(cap).tanh_().mul_(cap)
        return out

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
    callback (stage, done, total) per decoder layer, then ("evaluate head", sample, samples)."""
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
        big = min(seq - 1, window * max(1, HEAD_MATMUL_BYTES // (4 * vocab) // window))  # whole slices
        bufs = [torch.empty(1, big, vocab, device=device) for _ in sides]
        nll_ref = nll_cand = kl = agree = 0.0
        for s in range(n):
            xs = [side.store.read(s, s + 1, copy=False).to(device) for side in sides]  # read only
            for a0 in range(0, seq - 1, big):
                logits = [h(x[:, a0 : min(a0 + big, seq - 1)], buf) for h, x, buf in zip(heads, xs, bufs)]
                for a in range(a0, min(a0 + big, seq - 1), window):
                    b = min(a + window, seq - 1)
                    lr, lc = (F.log_softmax(lg[:, a - a0 : b - a0], dim=-1) for lg in logits)
                    target = input_ids[s : s + 1, a + 1 : b + 1].to(device).unsqueeze(-1)
                    nll_ref -= float(lr.gather(-1, target).sum())
                    nll_cand -= float(lc.gather(-1, target).sum())
                    kl += float(F.kl_div(lc, lr, reduction="sum", log_target=True))  # sum of p_ref (lr - lc)
                    agree += float((lr.argmax(-1) == lc.argmax(-1)).sum())
                del logits
            if progress:
                progress("evaluate head", s + 1, n)
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
