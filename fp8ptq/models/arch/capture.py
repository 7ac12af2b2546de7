"""How the generic adapter (models/arch/generic.py) reads a model: building it with its parameters on the
meta device, capturing what its decoder stack passes each layer, and probing a norm (w or 1 + w) and
whether a smoothing fold is exact for a layer as it runs."""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch

from fp8ptq.errors import ModelError

MODEL_FREE = "quantize it data-free by tensor names: `fp8ptq model-free MODEL -r fp8-dynamic -o OUT`"
# what a recorder drops from a layer's arguments: the cache and output switches, not the layer's inputs
SKIP_KWARGS = ("past_key_values", "past_key_value", "cache_params", "use_cache", "output_attentions")


def cast_arguments(value, device, dtype: torch.dtype):
    """Captured layer arguments on `device`, floating tensors in `dtype` (nested tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(cast_arguments(v, device, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_arguments(v, device, dtype) for k, v in value.items()}
    return value


def uses_attention_interface(cls: type) -> bool:
    """Whether a module class's forward goes through transformers' attention interface (its KV cache)."""
    if not issubclass(cls, torch.nn.Module) or cls.forward is torch.nn.Module.forward:
        return False
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or "attention_interface" in source


class _Stop(Exception):
    pass


def record_layers(
    arch, model: torch.nn.Module, run, carry=None, stop: int | None = None
) -> dict[int, tuple[torch.Tensor, tuple, dict]]:
    """(hidden states, args, kwargs) that `run()` (a forward of the model or of its decoder stack) passes
    each decoder layer, recorded by stubs in place of the layers: each passes its hidden states on, the
    last one (or the `stop`-th) stops the forward. The stubs carry the layers' plain attributes (stacks
    read attention_type and the like off a layer). A layer returning a tuple gives (hidden states, carry).
    run()'s own exceptions propagate; the layers are always put back."""
    stack_name, _, attr = arch.layers.rpartition(".")
    stack = model.get_submodule(stack_name)
    layers = getattr(stack, attr)
    seen: dict[int, tuple[torch.Tensor, tuple, dict]] = {}

    class Recorder(torch.nn.Module):
        def __init__(self, index: int, like: torch.nn.Module):
            super().__init__()
            self.index = index
            carry_attributes(self, like)

        def forward(self, hidden_states, *args, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k not in SKIP_KWARGS}
            seen[self.index] = (hidden_states, args, kwargs)
            if self.index + 1 == (stop or len(layers)):
                raise _Stop
            # a layer whose forward returns a tuple: (hidden, None) reads as either `out[0]` or `h, _ = out`
            return (hidden_states, carry) if returns_tuple(layers[self.index]) else hidden_states

    setattr(stack, attr, torch.nn.ModuleList(Recorder(i, layer) for i, layer in enumerate(layers)))
    try:
        with torch.inference_mode():
            run()
    except _Stop:
        pass
    finally:
        setattr(stack, attr, layers)
    return seen


def record_stack(arch, model: torch.nn.Module, run, what: str, carry=None, stop: int | None = None) -> dict:
    """record_layers, a failure of the stack's own forward reported as the typed error that names the
    model and `what` was being done ("to capture its layers' inputs", "on sample 3")."""
    try:
        return record_layers(arch, model, run, carry, stop)
    except Exception as err:  # noqa: BLE001 - a foreign stack's failure is reported by name
        raise ModelError(
            f"the generic path could not run the decoder stack of '{arch.name}' {what}: {type(err).__name__}: {err}",
            fix=MODEL_FREE,
        ) from None


def carry_attributes(stub: torch.nn.Module, like: torch.nn.Module) -> None:
    """Give a stub in place of a layer the layer's plain attributes: stacks read attention_type and the
    like off their layers."""
    for k, v in vars(like).items():
        if not k.startswith("_") and not isinstance(v, torch.nn.Module) and k not in ("training",):
            stub.__dict__.setdefault(k, v)


def capture(arch, model: torch.nn.Module, seq_len: int, device) -> dict[int, tuple[tuple, dict]]:
    """(args, kwargs) besides the hidden states that the decoder stack passes each layer for positions
    0..seq_len-1 (batch 1), recorded (record_layers) while the stack runs on zeros."""
    stack = model.get_submodule(arch.layers.rpartition(".")[0])
    if arch.rotary:
        model.get_submodule(arch.rotary).to(device)
    zeros = torch.zeros(1, seq_len, model.config.get_text_config().hidden_size, device=device)
    extras = getattr(arch, "stack_inputs", ())

    def run():
        if not extras:
            return stack(inputs_embeds=zeros, use_cache=False)
        # a stack that reads its own modules beside the layers runs on token ids, those modules zeros
        with swapped(model, {n: zeros_of(model, n, device) for n in (arch.embed, *extras)}):
            return stack(input_ids=torch.zeros(1, seq_len, dtype=torch.long, device=device), use_cache=False)

    carry = object()  # what a stubbed layer returns beside its hidden states: found in a later layer's arguments,
    # the stack threads a second stream from layer to layer
    seen = record_stack(arch, model, run, "to capture its layers' inputs", carry if extras else None)
    layers = len(arch.decoder_layers(model))
    if len(seen) != layers:
        raise ModelError(
            f"the decoder stack of '{arch.name}' called {len(seen)} of its {layers} layers",
            fix="quantize it data-free by tensor names: `fp8ptq model-free MODEL -r fp8-dynamic -o OUT`",
        )
    threaded = [i for i, (_hidden, args, kwargs) in seen.items() if _holds(carry, (args, kwargs))]
    if threaded:
        raise ModelError(
            f"the decoder stack of '{arch.name}' passes each layer an output of the layer before (layer "
            f"{threaded[0]}'s arguments): a second stream beside the hidden states, which the layer-by-layer "
            "generic path does not carry",
            fix=MODEL_FREE,
        )
    return {i: (args, kwargs) for i, (_hidden, args, kwargs) in seen.items()}


def _holds(value, found) -> bool:
    """Whether `found` is `value` or holds it (in tuples, lists, dicts)."""
    if found is value:
        return True
    if isinstance(found, (tuple, list)):
        return any(_holds(value, f) for f in found)
    return isinstance(found, dict) and any(_holds(value, f) for f in found.values())


def stack_inputs(
    model: torch.nn.Module, decoder: torch.nn.Module, skip: tuple[torch.nn.Module, ...]
) -> tuple[str, ...]:
    """The modules and parameters of the decoder stack that hold weights besides `skip` (its embedding,
    layer list, final norm, rotary embedding), by their names in `model`: what else its forward reads
    (Gemma 4's per-layer embeddings and their projection, ZAYA's input scale and bias)."""
    stack = next(n for n, m in model.named_modules() if m is decoder)
    at = f"{stack}." if stack else ""
    held = [
        n
        for n, m in decoder.named_children()
        if all(m is not s for s in skip) and next(m.parameters(), None) is not None
    ]
    return tuple(at + n for n in held + [n for n, p in decoder._parameters.items() if p is not None])


class ZeroEmbedding(torch.nn.Module):
    """An embedding that gives zeros: the stack's lookups when its layers' inputs are captured without weights."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.dim, device=ids.device)


def zeros_of(model: torch.nn.Module, name: str, device):
    """A stand-in for the submodule or parameter `name` holding zeros on `device` (embeddings: ZeroEmbedding)."""
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent)
    if leaf not in owner._modules:
        return torch.nn.Parameter(torch.zeros(owner._parameters[leaf].shape, device=device), requires_grad=False)
    module = owner._modules[leaf]
    if isinstance(module, torch.nn.Embedding):
        return ZeroEmbedding(module.embedding_dim)
    module = copy.deepcopy(module)  # the skeleton's own stays on meta
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = torch.nn.Parameter(torch.zeros(p.shape, device=device), requires_grad=False)
    return module.to(device)


@contextlib.contextmanager
def swapped(model: torch.nn.Module, values: dict):
    """Submodules or parameters of `model` (name -> stand-in) replaced for the block, then put back."""
    old = {}
    for name, value in values.items():
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        table = owner._modules if leaf in owner._modules else owner._parameters
        old[name] = (table, leaf, table[leaf])
        table[leaf] = value
    try:
        yield
    finally:
        for table, leaf, value in old.values():
            table[leaf] = value


def returns_tuple(layer: torch.nn.Module) -> bool:
    ann = inspect.signature(type(layer).forward).return_annotation
    return "tuple" in str(ann).lower()


@contextlib.contextmanager
def meta_parameters():
    """Build modules with parameters on the meta device and buffers real (rotary frequencies, embedding
    scales: computed by the constructors from the config)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # a tied weight is registered again as itself
            p = module._parameters[name]
            module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def build_model(config, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The model's module tree (parameters on meta), as the causal-LM or image-text-to-text class."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    errors = []
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            with meta_parameters():
                model = auto.from_config(config, attn_implementation=attn_implementation, trust_remote_code=False)
            name_like_base(model)
            return model
        except ValueError as err:  # not a model type of this auto class, or no SDPA attention
            if "sdpa" in attn_implementation and "scaled_dot_product_attention" in str(err):
                raise NoSdpa from None
            errors.append(str(err).splitlines()[0])
    raise ModelError(
        f"transformers cannot build a model of type '{config.model_type}' ({'; '.join(errors)})",
        fix="quantize it data-free by tensor names: `fp8ptq model-free MODEL -r fp8-dynamic -o OUT`",
    )


class AttentionName(str):
    """The name of an fp8ptq attention function that wraps transformers' SDPA or eager function, equal to
    that function's name too. Model code picks paths by comparing config._attn_implementation with
    "eager" or "sdpa" (DSA layers apply their top-k index mask only then); under a name of its own the
    wrapped model would take another path than transformers' forward. Dict lookups (the attention and
    mask interfaces) still hash the wrapper's own name, so the wrapper stays the function called."""

    base: str

    def __new__(cls, name: str, base: str = ""):  # no base: unpickling (the state restores it)
        self = super().__new__(cls, name)
        self.base = base
        return self

    def __eq__(self, other) -> bool:
        return str.__eq__(self, other) or (isinstance(other, str) and str.__eq__(other, self.base))

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__


def name_like_base(model: torch.nn.Module) -> None:
    """Every config of the model whose attention is an fp8ptq wrapper ("fp8ptq_sdpa"): its name as an
    AttentionName equal to the wrapped function's ("sdpa"). Set on each config itself: a vision tower's
    sub-config keeps its own implementation."""
    from transformers import PretrainedConfig

    configs = {id(c): c for m in model.modules() if isinstance(c := getattr(m, "config", None), PretrainedConfig)}
    for c in configs.values():
        name = getattr(c, "_attn_implementation_internal", None)
        base = next((b for b in ("sdpa", "eager") if isinstance(name, str) and name.endswith("_" + b)), None)
        if base is not None and not isinstance(name, AttentionName):
            c._attn_implementation_internal = AttentionName(name, base)


class NoSdpa(Exception):
    """transformers refuses SDPA for this family (Gemma 2's soft-capping, e.g.): eager attention."""


def is_norm(m: torch.nn.Module) -> bool:
    w = m._parameters.get("weight")
    return "norm" in type(m).__name__.lower() and w is not None and w.dim() == 1 and m._parameters.get("bias") is None


def norm_offset(norm: torch.nn.Module) -> float | None:
    """0 when the norm computes normalized(x) * w, 1 for normalized(x) * (1 + w) (Gemma), None otherwise:
    probed on a random input with w = 0 and w = -1."""
    w = norm.weight.data.clone()
    x = torch.randn(2, w.numel(), generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    try:
        with torch.no_grad():
            for offset in (0.0, 1.0):
                norm.weight.data.fill_(-offset)
                if not bool(norm(x).any()):
                    return offset
    finally:
        norm.weight.data.copy_(w)
    return None


def fold_is_exact(run, base: torch.Tensor, norm: torch.nn.Module, linears: list[torch.nn.Module]) -> bool:
    """Whether scaling the norm's output by 1/s and the Linears' inputs by s leaves the layer's output
    unchanged, for a random positive s: exactly what folding s into the norm and the weights does."""
    s = torch.exp(torch.randn(norm.weight.numel(), generator=torch.Generator().manual_seed(1)) * 0.5)
    s = s.to(norm.weight.device, base.dtype)
    hooks = [norm.register_forward_hook(lambda _m, _a, out: out / s)]
    hooks += [m.register_forward_pre_hook(lambda _m, a: (a[0] * s, *a[1:])) for m in linears]
    try:
        out = run()
    finally:
        for h in hooks:
            h.remove()
    return bool(torch.allclose(out, base, rtol=1e-4, atol=1e-5 * float(base.abs().max())))


# -- checkpoint names: transformers' own renaming rules --------------------------------------------------
def stored_path(model: torch.nn.Module, layers: str, relative: str) -> str:
    """The checkpoint's layer-relative path of a module transformers renames on load (phimoe's router
    `mlp.router` is stored as `block_sparse_moe.gate`), by transformers' own rules run in reverse."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    rules = [t.reverse_transform() for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    for i in range(len(model.get_submodule(layers))):
        name = f"{layers}.{i}.{relative}.weight"
        if name in model.state_dict():
            stored = rename_source_key(name, rules, [], model.base_model_prefix, None, reverse=True)[0]
            return stored.rpartition(f".{i}.")[2].removesuffix(".weight")
    return relative


def stored_name(name: str, renames: dict[str, str]) -> str:
    """The stored name of a module-named tensor under `renames` (GenericArch.renames): its own, else by the
    longest renamed prefix it lies under."""
    if name in renames:
        return renames[name]
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i]) + "."
        if prefix in renames:
            return renames[prefix] + name[len(prefix) :]
    return name


def prefix_pairs(renames: dict[str, str]) -> set[tuple[str, str]]:
    """(new prefix, stored prefix) candidates: each renamed pair with its common dotted suffix removed."""
    pairs = set()
    for new, old in renames.items():
        a, b = new.split("."), old.split(".")
        while a and b and a[-1] == b[-1]:
            a, b = a[:-1], b[:-1]
        if a and b:
            pairs.add((".".join(a) + ".", ".".join(b) + "."))
    return pairs
