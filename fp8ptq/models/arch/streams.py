"""The residual stream between decoder layers, where the decoder stack does not pass a layer its embeddings.

Most stacks hand the first layer the embeddings and the final norm the last layer's output: the stream is
[batch, tokens, hidden] throughout. Hyper-connection stacks keep several residual streams instead: the
stack widens the embeddings to [batch, tokens, streams, hidden] before the first layer, every layer maps
that shape to itself, and modules of the stack (a mixing head) collapse it after the last layer, before the
final norm. The activation stores hold one row of `width` values per token, so such a stream is stored
flattened and shaped back for each layer.

Both ends are the stack's own code, run with the layers replaced by stubs (capture.record_layers): what the
stack passes the first layer for given embeddings, and what reaches the final norm when the last layer
returns given states. Nothing about a family's streams is re-derived here.
"""

from __future__ import annotations

import math

import torch

from fp8ptq.errors import ModelError
from fp8ptq.models.arch.capture import (
    MODEL_FREE,
    carry_attributes,
    record_layers,
    record_stack,
    returns_tuple,
    swapped,
    zeros_of,
)

PROBE_TOKENS = 4


class _AtNorm(Exception):
    pass


class Streams:
    """The hooks of `Arch` that the residual stream's shape changes, for an arch with a `skeleton` (the
    generic adapter): a mixin, so the adapter's own module stays about its layout."""

    def stream_shape(self, model: torch.nn.Module) -> tuple[int, ...]:
        """One token's residual stream between layers, as the stack passes it to the first layer
        ((hidden,) for most stacks, (streams, hidden) for hyper-connections). Probed once on the
        skeleton with random embeddings."""
        if "stream" not in self._cache:
            hidden = model.config.get_text_config().hidden_size
            if getattr(self, "stack_inputs", ()):
                # the stack's own forward gives each sample its first-layer input (models/arch/tokens.py):
                # only the stream's shape is probed, on zero stand-ins for the weights it reads
                shape = tuple(_first_token_input(self, model).shape[2:])
                self._cache["stream"] = (shape, shape == (hidden,))
                return shape
            x = torch.randn(1, PROBE_TOKENS, hidden, generator=torch.Generator().manual_seed(0))
            first = _first_input(self, model, x.to(_stack_device(self, model)))
            shape = tuple(first.shape[2:])
            # the embeddings themselves: both ends are the identity, nothing of the stack runs for them
            plain = shape == (hidden,) and bool(torch.equal(first.cpu(), x))
            self._cache["stream"] = (shape, plain)
        return self._cache["stream"][0]

    def plain_stream(self, model: torch.nn.Module) -> bool:
        self.stream_shape(model)
        return self._cache["stream"][1]

    def stream_width(self, model: torch.nn.Module) -> int:
        return math.prod(self.stream_shape(model))

    def enter(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The first layer's input for embeddings x [b, t, hidden], flattened to [b, t, width]."""
        if self.plain_stream(model):
            return x
        return _first_input(self, model, x.to(_stack_device(self, model))).reshape(*x.shape[:2], -1)

    def leave(self, model: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
        """The final norm's input when the last layer outputs y [b, t, width] (flattened)."""
        if self.plain_stream(model):
            return y
        return _norm_input(self, model, y.reshape(*y.shape[:2], *self.stream_shape(model)))

    def stack_modules(self, model: torch.nn.Module) -> list[str]:
        """Modules of the stack beside its layers, embeddings and final norm whose parameters `leave`
        may read (a mixing head): loaded with the final norm. None for a plain stream."""
        if self.plain_stream(model):
            return []
        stack = self.layers.rpartition(".")[0]
        skip = {self.layers, self.embed, self.final_norm, self.rotary}
        return [
            f"{stack}.{n}" if stack else n
            for n, m in model.get_submodule(stack).named_children()
            if (f"{stack}.{n}" if stack else n) not in skip and next(m.parameters(), None) is not None
        ]

    def run_block(self, layer: torch.nn.Module, block, x: torch.Tensor, inputs) -> torch.Tensor:
        shape = self.stream_shape(self.skeleton)
        out = layer(x.reshape(*x.shape[:2], *shape), *inputs.args, **inputs.kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(*x.shape[:2], -1) if len(shape) > 1 else out


def _stack_device(arch, model: torch.nn.Module) -> torch.device:
    rotary = model.get_submodule(arch.rotary) if arch.rotary else None
    buffer = next(rotary.buffers(), None) if rotary is not None else None
    return buffer.device if buffer is not None else torch.device("cpu")


def _run_stack(arch, model: torch.nn.Module, x: torch.Tensor):
    stack = model.get_submodule(arch.layers.rpartition(".")[0])
    return lambda: stack(inputs_embeds=x, use_cache=False)


def _first_input(arch, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return record_stack(arch, model, _run_stack(arch, model, x), "to find its first layer's input", stop=1)[0][0]


def _first_token_input(arch, model: torch.nn.Module) -> torch.Tensor:
    stack = model.get_submodule(arch.layers.rpartition(".")[0])
    device = _stack_device(arch, model)
    ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device=device)
    with swapped(model, {n: zeros_of(model, n, device) for n in (arch.embed, *arch.stack_inputs)}):
        seen = record_stack(arch, model, lambda: stack(input_ids=ids, use_cache=False), "to find its stream", stop=1)
    return seen[0][0]


def _norm_input(arch, model: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
    """What the stack passes its final norm when its last layer returns y: its layers replaced by stubs
    that pass their input on, the last one returning y, the forward stopped at the norm."""
    stack_name, _, attr = arch.layers.rpartition(".")
    stack = model.get_submodule(stack_name)
    layers = getattr(stack, attr)
    seen = []

    class Stub(torch.nn.Module):
        def __init__(self, index: int):
            super().__init__()
            self.index = index
            carry_attributes(self, layers[index])

        def forward(self, hidden_states, *args, **kwargs):
            out = y if self.index + 1 == len(layers) else hidden_states
            return (out, None) if returns_tuple(layers[self.index]) else out

    def at_norm(_m, args):
        seen.append(args[0])
        raise _AtNorm

    hook = model.get_submodule(arch.final_norm).register_forward_pre_hook(at_norm)
    setattr(stack, attr, torch.nn.ModuleList(Stub(i) for i in range(len(layers))))
    hidden = model.config.get_text_config().hidden_size
    try:
        with torch.inference_mode():
            _run_stack(arch, model, torch.zeros(*y.shape[:2], hidden, device=y.device, dtype=y.dtype))()
    except _AtNorm:
        pass
    finally:
        setattr(stack, attr, layers)
        hook.remove()
    if not seen:
        raise ModelError(f"the decoder stack of '{arch.name}' never reached its final norm", fix=MODEL_FREE)
    return seen[0]


def read_before_layers(model: torch.nn.Module, layers: str, embed: str, names: tuple[str, ...]) -> tuple[str, ...]:
    """The `names` (stack_inputs) that the stack's forward reads before its last layer. A module only the
    stack's end reads (a hyper-connection head merging the streams for the final norm) is not an input of
    the layers: found by running the stack on zero stand-ins with the layers stubbed, the stubs stopping
    the forward at the last layer. Parameters cannot be watched and are kept."""
    if not names:
        return names
    values = {n: zeros_of(model, n, "cpu") for n in (embed, *names)}
    called: set[str] = set()
    hooks = [
        values[n].register_forward_pre_hook(lambda *_a, n=n: called.add(n))
        for n in names
        if isinstance(values[n], torch.nn.Module)
    ]
    stack = model.get_submodule(layers.rpartition(".")[0])
    ids = torch.zeros(1, 4, dtype=torch.long)
    try:
        with swapped(model, values):
            record_layers(_Layers(layers), model, lambda: stack(input_ids=ids, use_cache=False))
    except Exception:  # noqa: BLE001 - capture() reports a stack that cannot run, by name
        return names
    finally:
        for h in hooks:
            h.remove()
    return tuple(n for n in names if n in called or not isinstance(values[n], torch.nn.Module))


class _Layers:
    """Where a stack's layer list is, for record_layers before an Arch exists."""

    def __init__(self, layers: str):
        self.layers = layers
