"""Decoder stacks whose layers' inputs depend on the tokens beyond the embedding (the generic adapter).

Most stacks give their first layer the embedded tokens and every layer the same positions and masks, so
`GenericArch.layer_inputs` captures one set of arguments on a zero input. A stack holding weights beside
its embedding, layers, final norm and rotary embedding (`GenericArch.stack_inputs`) computes more from
the tokens: Gemma 4 gives each layer a `per_layer_input` (its per-layer embedding of the token ids plus a
projection of the embeddings), ZAYA scales and shifts the embeddings before the first layer. Such a stack
runs, sample by sample, its own forward on the sample's token ids with those weights read from the
checkpoint and the layers replaced by recorders: the first layer's input and every layer's arguments are
then exactly what transformers' forward gives them, with no family's rules re-derived here.
"""

from __future__ import annotations

import copy

import torch

from fp8ptq.errors import ModelError
from fp8ptq.models.arch.capture import record_stack, swapped
from fp8ptq.models.arch.generic import CapturedInputs


def reads_tokens(arch) -> bool:
    """Whether the layers' inputs depend on the tokens beyond the embedding (see module doc)."""
    return bool(getattr(arch, "stack_inputs", ()))


def _loaded(model: torch.nn.Module, src, name: str, device):
    """A copy of the submodule or parameter `name`, its weights read from the checkpoint (fp32) on `device`."""
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent)
    if leaf not in owner._modules:
        return torch.nn.Parameter(src.tensor(name).float().to(device), requires_grad=False)
    module = copy.deepcopy(owner._modules[leaf])  # the skeleton's own stays on meta
    state = {n: src.tensor(f"{name}.{n}").float() for n, _ in module.named_parameters()}
    module.load_state_dict(state, strict=False, assign=True)
    return module.to(device)


def _shared(got, want):
    """`got` with every tensor equal to its counterpart in `want` replaced by that one (the arguments every
    sample shares, positions and masks, are then held once); other values stay `got`'s own."""
    if isinstance(got, torch.Tensor):
        same = isinstance(want, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
        return want if same and torch.equal(got, want.to(got.device)) else got
    if isinstance(got, (tuple, list)) and isinstance(want, (tuple, list)) and len(got) == len(want):
        return type(got)(_shared(g, w) for g, w in zip(got, want))
    if type(got) is dict and isinstance(want, dict):
        return {k: _shared(v, want.get(k)) for k, v in got.items()}
    return got


@torch.inference_mode()
def sample_inputs(arch, model: torch.nn.Module, src, input_ids: torch.Tensor, shared, *, samples: range, device):
    """(sample index, first-layer input [1, seq_len, hidden] fp32, each layer's CapturedInputs) for the
    samples in `samples`: the stack's own forward on the sample's token ids, its embedding and its other
    weights (`arch.stack_inputs`) read from `src`. shared: layer index -> the zero-input capture, whose
    tensors stand in for equal ones."""
    stack = model.get_submodule(arch.layers.rpartition(".")[0])
    layers = len(arch.decoder_layers(model))
    values = {n: _loaded(model, src, n, device) for n in (arch.embed, *arch.stack_inputs)}
    src.close()
    with swapped(model, values):
        for i in samples:
            ids = input_ids[i : i + 1].to(device)
            seen = record_stack(arch, model, lambda ids=ids: stack(input_ids=ids, use_cache=False), f"on sample {i}")
            if len(seen) != layers:
                raise ModelError(f"the decoder stack of '{arch.name}' called {len(seen)} of its {layers} layers")
            own = []
            for j in range(layers):
                base = shared(j)
                args, kwargs = _shared((seen[j][1], seen[j][2]), (base.args, base.kwargs))
                own.append(CapturedInputs(None, None, args, kwargs, base.short))
            yield i, seen[0][0].float().reshape(1, ids.shape[1], -1), own  # a widened stream, flattened
