"""The generic adapter: the layout of any decoder model transformers can build, discovered from the model.

For a `model_type` no adapter registers, `discover(config)` builds the model's module tree on the meta
device (`AutoModelForCausalLM`, else `AutoModelForImageTextToText` for multimodal checkpoints) and reads:

- the decoder stack (`get_decoder()`) and its layer list (the ModuleList of num_hidden_layers blocks);
  each layer runs whole, with every argument the model's own forward passes it (captured by recording
  stubs, as `Arch.layer_inputs` does for the adapters), so hybrid stacks (linear attention, Mamba
  mixers) and per-layer masks need no rules here;
- the Linears that read the same input tensor (vLLM's fused shards: q/k/v, gate/up, MLA's q_a/kv_a,
  a linear-attention block's input projections), traced per layer on a 4-token input: they share
  scales the way vLLM's loader expects;
- the attention modules: those whose forward goes through transformers' attention interface (the
  KV-cache scales are theirs; a layer without one has no KV cache);
- transformers' fused 3-D experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), unfused per
  expert under the checkpoint's names (models/moe.py);
- the modules that choose (routers, a sparse attention's indexer): traced to a top-k selection
  (models/arch/lineage.py), with the experts' one-row shared-expert gates, kept float and in `ignore`;
- towers beside the decoder (vision, audio, projectors): copied unchanged and ignored.

What only a person knows stays unsaid and its transforms are refused (`refuses`): which norm feeds which
Linears (SmoothQuant, rotations), an MLP FlattenQuant may widen, a norm computed as (1 + w).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from dataclasses import dataclass, field

import torch

from fp8ptq.errors import ModelError
from fp8ptq.models.arch.base import Arch, Block, LayerInputs, SmoothGroup, is_latent
from fp8ptq.models.arch.capture import (
    MODEL_FREE,
    NoSdpa,
    build_model,
    capture,
    cast_arguments,
    fold_is_exact,
    is_norm,
    norm_offset,
    stack_inputs,
    stored_path,
    uses_attention_interface,
)
from fp8ptq.models.arch.discovery import contains, final_norms, fused_modules, layer_lists, top_modules
from fp8ptq.models.arch.lineage import Lineage, random_copy, without_fused_experts, without_routed_experts
from fp8ptq.models.arch.stored import renames as stored_renames
from fp8ptq.models.arch.stored import source_views, stored_tower_prefixes
from fp8ptq.models.arch.streams import Streams, read_before_layers
from fp8ptq.models.moe import (
    GATE_UP_DOWN,
    UP_DOWN,
    fused_experts,
    stored_expert_leaves,
    unfuse_experts,
)

LAYER = Block("layer", "", "")  # the whole decoder layer, called with its captured arguments
TRACE_TOKENS = 4


@dataclass(frozen=True)
class CapturedInputs(LayerInputs):
    """Every argument the decoder stack passes a layer besides the hidden states, at two lengths (the
    calibration length and TRACE_TOKENS, for tracing on a short slice)."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    short: CapturedInputs | None = None

    def head(self, n: int) -> LayerInputs:
        assert self.short is not None and n == TRACE_TOKENS, f"captured inputs of {TRACE_TOKENS} tokens, not {n}"
        return self.short


@dataclass(frozen=True)
class GenericArch(Streams, Arch):
    """An `Arch` discovered from a transformers model (see module doc); each layer runs whole with its
    captured arguments, on the stack's residual stream (models/arch/streams.py)."""

    towers: tuple[str, ...] = ()  # modules beside the decoder (vision, audio, projectors): kept as stored
    norm_at: str = ""  # the norm after the last decoder layer
    experts_at: tuple[str, ...] = ()  # layer-relative names of fused 3-D experts modules to unfuse
    stack_inputs: tuple[str, ...] = ()  # what else the stack reads (capture.stack_inputs): see models/arch/tokens.py
    skeleton: torch.nn.Module | None = field(default=None, repr=False, compare=False)  # for tracing
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def final_norm(self) -> str:
        return self.norm_at

    @property
    def described(self) -> str:
        return f"{self.name}'s layout (discovered from the model; no fp8ptq adapter)"

    def check_layer(self, layer: torch.nn.Module, index: int) -> None:
        return None

    def layer_count(self, config) -> int:
        return len(self.skeleton.get_submodule(self.layers))

    def attention_of(self, layer: torch.nn.Module) -> str | None:
        found = [n for n, m in layer.named_modules() if uses_attention_interface(type(m))]
        return found[0] if found else None

    # -- inputs ----------------------------------------------------------------------------------------
    def layer_inputs(self, model: torch.nn.Module, seq_len: int, device):
        full = capture(self, model, seq_len, device)
        short = capture(self, model, TRACE_TOKENS, device)
        return {
            i: CapturedInputs(None, None, a, k, CapturedInputs(None, None, *short[i])) for i, (a, k) in full.items()
        }.__getitem__

    # -- shared inputs ---------------------------------------------------------------------------------
    def shared_inputs(self, layer: torch.nn.Module, prefix: str) -> list[tuple[str, ...]]:
        """The layer's Linears grouped by the input tensor they read (call order), traced on a random
        TRACE_TOKENS-token input with the layer's own arguments. Routed experts do not run: their gate/up
        read one input by construction (models/moe.py). A layer on the meta device (data-free runs) is
        traced on a random copy without them. Cached per layer structure."""
        from fp8ptq.models.moe import ExpertMLP

        index = int(prefix[len(self.layers) + 1 : -1])  # "model.layers.3." -> 3
        signature = tuple((n, type(m).__name__) for n, m in layer.named_modules())
        if signature in self._cache:
            return self._cache[signature]
        probe = layer
        if any(p.is_meta for p in layer.parameters()):
            probe = random_copy(layer, without_routed_experts)
        groups = self._trace(probe, index)
        for n, m in layer.named_modules():
            if isinstance(m, ExpertMLP):
                gate, up, down = (f"{n}.{leaf}" if leaf else None for leaf in m.names)
                groups += [(gate, up) if gate else (up,), (down,)]
        self._cache[signature] = groups
        return groups

    def _trace(self, layer: torch.nn.Module, index: int) -> list[tuple[str, ...]]:
        from fp8ptq.models.moe import Experts

        run = self._runner(layer, index)
        seen: list[tuple[str, torch.Tensor]] = []
        experts = [m for m in layer.modules() if isinstance(m, Experts)]
        inside = {id(x) for m in experts for x in m.modules()}  # routed experts: grouped by construction
        handles = [  # before any other hook: an installed input quantizer makes a new tensor per Linear
            m.register_forward_pre_hook(lambda _m, a, n=n: seen.append((n, a[0])), prepend=True)
            for n, m in layer.named_modules()
            if isinstance(m, torch.nn.Linear) and id(m) not in inside
        ]
        for m in experts:
            m.only = frozenset()  # no routed expert runs in the trace
        try:
            run()
        finally:
            for h in handles:
                h.remove()
            for m in experts:
                m.only = None
        groups: list[list[str]] = []
        by_input: dict[int, list[str]] = {}
        for name, t in seen:
            if name in {n for g in groups for n in g}:
                continue  # a Linear called twice (shared weights): its first input decides
            if id(t) not in by_input:
                by_input[id(t)] = []
                groups.append(by_input[id(t)])
            by_input[id(t)].append(name)
        return [tuple(g) for g in groups]

    def smooth_groups(self, layer: torch.nn.Module, prefix: str) -> tuple[SmoothGroup, ...]:
        """SmoothQuant's norm -> Linears maps of a layer, observed rather than said: a norm whose output
        tensor is the input of a group of Linears (traced), kept only when the fold is exact for the
        layer as it runs: scaling the norm's output by 1/s and those Linears' inputs by s leaves the
        layer's output unchanged (no router, gate or other module reads that output), and the norm
        multiplies by w or by (1 + w) (probed with w = 0 and w = -1). The first such group of a layer is
        'qkv' (the token mixer's input), the second 'gate_up' (the MLP's). Cached per layer structure."""
        from fp8ptq.models.moe import Experts

        signature = ("smooth", *((n, type(m).__name__) for n, m in layer.named_modules()))
        if signature in self._cache:
            return self._cache[signature]
        index = int(prefix[len(self.layers) + 1 : -1])
        groups = self.shared_inputs(layer, prefix)
        modules = dict(layer.named_modules())
        norms = {n: m for n, m in modules.items() if is_norm(m)}
        inside = {id(x) for m in modules.values() if isinstance(m, Experts) for x in m.modules()}
        run = self._runner(layer, index)
        produced: dict[int, str] = {}  # id of a norm's output -> the norm
        read: dict[tuple, int] = {}  # group -> id of its input
        keep: list[torch.Tensor] = []  # the traced tensors stay alive: their ids stay unique

        def norm_hook(name):
            def hook(_m, _args, out):
                keep.append(out)
                produced.setdefault(id(out), name)

            return hook

        def group_hook(group):
            def hook(_m, args):
                keep.append(args[0])
                read.setdefault(group, id(args[0]))

            return hook

        hooks = [m.register_forward_hook(norm_hook(n)) for n, m in norms.items()]
        hooks += [
            modules[g[0]].register_forward_pre_hook(group_hook(g), prepend=True)
            for g in groups
            if id(modules[g[0]]) not in inside
        ]
        try:
            base = run()
        finally:
            for h in hooks:
                h.remove()
        found: list[SmoothGroup] = []
        for g in groups:
            norm = produced.get(read.get(g, -1))
            if norm is None or any(f.norm == norm for f in found) or len(found) == 2:
                continue
            offset = norm_offset(norms[norm])
            if offset is not None and fold_is_exact(run, base, norms[norm], [modules[n] for n in g]):
                found.append(SmoothGroup(("qkv", "gate_up")[len(found)], norm, g, offset))
        self._cache[signature] = tuple(found)
        return self._cache[signature]

    def selecting(self, layer: torch.nn.Module, index: int) -> frozenset[str]:
        """The modules of `layer` whose output reaches a top-k selection (models/arch/lineage.py), traced
        on a random TRACE_TOKENS input with the layer's own arguments."""
        lineage = Lineage(layer)
        self._runner(layer, index, lineage)()
        return frozenset(lineage.chosen)

    def _runner(self, layer: torch.nn.Module, index: int, lineage: Lineage | None = None):
        """A function running `layer` on a fixed random TRACE_TOKENS input with its captured arguments
        (inside `lineage`, seeded with that input, when given)."""
        if "short" not in self._cache:  # every layer's arguments from one run of the stack
            self._cache["short"] = capture(self, self.skeleton, TRACE_TOKENS, "cpu")
        args, kwargs = self._cache["short"][index]
        p = next(layer.parameters())
        args, kwargs = cast_arguments((args, kwargs), p.device, p.dtype)  # a bf16 layer takes bf16 rotary
        gen = torch.Generator().manual_seed(index)
        x = torch.randn(1, TRACE_TOKENS, self.stream_width(self.skeleton), generator=gen).to(p.device, p.dtype)

        if lineage is not None:
            lineage.seed(x)

        def run():
            try:
                with torch.inference_mode(), lineage or contextlib.nullcontext():
                    out = self.run_block(layer, LAYER, x, CapturedInputs(None, None, args, kwargs))
            except Exception as err:  # noqa: BLE001 - any failure of a foreign forward is reported by name
                raise ModelError(
                    f"the generic path could not run decoder layer {index} ({type(layer).__name__}): "
                    f"{type(err).__name__}: {err}",
                    fix=MODEL_FREE,
                ) from None
            return out

        return run

    def renames(self, stored: list[str]) -> dict[str, str]:
        """Module name -> stored name for the checkpoint names transformers renames on load (its own
        WeightRenaming rules: legacy multimodal prefixes, `backbone.` -> `model.`, `block_sparse_moe.` ->
        `mlp.`). Entries ending in "." are prefixes under which every stored tensor is renamed, so tensors
        an export adds (a Linear's scales, an attention's KV scales) are named as their module's."""
        return stored_renames(self.skeleton, stored)


def discover(config) -> GenericArch:
    """The generic adapter of a transformers config (see module doc); ModelError naming what is missing."""
    try:
        model, eager = build_model(config), False
    except NoSdpa:
        model, eager = build_model(config, "eager"), True
    names = {id(m): n for n, m in model.named_modules()}
    text = config.get_text_config()
    where = f"'{config.model_type}'"
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or id(decoder) not in names:
        raise ModelError(f"{where}: transformers' model has no decoder stack (get_decoder)", fix=MODEL_FREE)
    stack = names[id(decoder)]
    lists, counts = layer_lists(decoder, text)
    if len(lists) != 1:
        raise ModelError(f"{where}: the decoder stack has {len(lists)} layer lists of {counts}", fix=MODEL_FREE)
    layers = f"{stack}.{lists[0]}" if stack else lists[0]
    kinds = {type(m).__name__ for m in model.get_submodule(layers).modules()}
    if "Linear" not in kinds:
        raise ModelError(
            f"{where}: its decoder layers hold no nn.Linear ({', '.join(sorted(kinds - {'ModuleList'}))[:120]}), "
            "the modules compressed-tensors quantizes",
            fix="quantize a family whose projections are nn.Linear",
        )
    embed_mod = model.get_input_embeddings()
    rotary = [n for n, m in decoder.named_children() if "Rotary" in type(m).__name__]
    norms = final_norms(decoder, lists[0], embed_mod)
    if len(norms) != 1:
        raise ModelError(
            f"{where}: the decoder stack has {len(norms)} norm modules, not one final norm", fix=MODEL_FREE
        )
    inputs = stack_inputs(
        model, decoder, (model.get_submodule(layers), embed_mod, *map(decoder.get_submodule, rotary + norms))
    )
    inputs = read_before_layers(model, layers, names[id(embed_mod)], inputs)
    scale = getattr(embed_mod, "embed_scale", None)
    towers = tuple(
        n for n, m in top_modules(model) if not contains(n, stack) and m is not model.get_output_embeddings()
    )
    experts_at, routers = fused_experts(model.get_submodule(layers))
    # a final module with weights (a stream mixer, not a norm) runs outside the layers: float
    final = any(isinstance(m, torch.nn.Linear) for m in decoder.get_submodule(norms[0]).modules())
    final_keep = (f"re:.*{re.escape(norms[0])}\\..*",) if final else ()
    leaves = stored_expert_leaves(model) if experts_at else None
    shapes = {}
    if experts_at and leaves is None:  # the checkpoint holds the experts fused, as the model does
        fused = fused_modules(model.get_submodule(layers), layers)
        gated = next(iter(fused.values()))[2]
        leaves = GATE_UP_DOWN if gated else UP_DOWN
        shapes = {path: (count, inter) for path, (count, inter, _) in fused.items()}
    views = functools.partial(source_views, skeleton=model, experts=shapes, leaves=leaves)
    arch = GenericArch(
        name=config.model_type,
        model_types=(config.model_type,),
        blocks=(LAYER,),
        fused={},
        attention="",
        kv_cache=not getattr(text, "kv_lora_rank", None),
        latent_kv=any(is_latent(m) for m in model.get_submodule(layers).modules()),
        expert_lists=experts_at,
        keep_float=_keep_float(model, layers, routers, towers, inputs) + final_keep,
        layers=layers,
        embed=names[id(embed_mod)],
        rotary=f"{stack}.{rotary[0]}" if rotary and stack else (rotary[0] if rotary else ""),
        embed_scale=None if not isinstance(scale, torch.Tensor) else (lambda _c, s=float(scale): s),
        eager_attention=eager,
        prepare_layer=functools.partial(_prepare, eager=eager, leaves=leaves) if eager or experts_at else None,
        source_views=views,
        towers=towers,
        norm_at=f"{stack}.{norms[0]}" if stack else norms[0],
        experts_at=experts_at,
        stack_inputs=inputs,
        skeleton=model,
    )
    chosen = set(routers) | _selecting(arch, model.get_submodule(layers))
    return dataclasses.replace(arch, keep_float=_keep_float(model, layers, chosen, towers, inputs) + final_keep)


def _selecting(arch: GenericArch, layers: torch.nn.ModuleList) -> frozenset[str]:
    """Layer-relative names of the modules whose output reaches a top-k selection (routers, a sparse
    attention's indexer: kept float), traced on a random copy of each distinct layer structure, its fused
    experts stubbed out. A layer that cannot run here adds nothing: the calibration run, which runs it the
    same way, names the failure."""
    found: set[str] = set()
    seen: set[tuple] = set()
    for index, layer in enumerate(layers):
        signature = tuple((n, type(m).__name__) for n, m in layer.named_modules())
        if signature in seen:
            continue
        seen.add(signature)
        try:
            found |= arch.selecting(random_copy(layer, without_fused_experts), index)
        except Exception:  # noqa: BLE001 - a layer this trace cannot run keeps the shape rule's routers
            continue
    return frozenset(found)


def _keep_float(model: torch.nn.Module, layers: str, routers, towers, inputs) -> tuple[str, ...]:
    """re: patterns of modules never quantized: the routers, by their module names and by the checkpoint's
    (what vLLM's modules are named); the towers beside the decoder; the stack's own weights beside its
    layers (the generic path calibrates the layers only)."""
    keep = tuple(sorted({f"re:.*{re.escape(n)}$" for r in routers for n in (r, stored_path(model, layers, r))}))
    keep += tuple(f"re:.*{re.escape(t.rpartition('.')[2])}\\..*" for t in towers) + stored_tower_prefixes(model, towers)
    return keep + tuple(f"re:.*{re.escape(n.rpartition('.')[2])}$" for n in inputs)


def _prepare(layer: torch.nn.Module, config, eager: bool, leaves: tuple | None) -> None:
    """Experts unfused under the checkpoint's names; eager-attention families: the KV-observing wrapper
    calls the family's own eager attention."""
    import sys

    if eager:
        for m in layer.modules():
            if uses_attention_interface(type(m)):
                m.fp8ptq_inner_attention = sys.modules[type(m).__module__].eager_attention_forward
    unfuse_experts(layer, config, leaves)
