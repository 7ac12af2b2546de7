"""What an architecture adapter says: where things are in a decoder model, as data plus a few hooks.

The calibration pipeline, the transforms, export and the evaluator read a model only through an
`Arch`: the decoder-layer list, the residual blocks of a layer (norm -> sub-module -> optional post
norm, with the Linear that produces the sub-module's output), the Linears vLLM fuses into one GEMM,
which norm feeds which Linears (SmoothQuant), the MLP that FlattenQuant may widen, the attention
module that sees post-RoPE keys/values, expert lists of MoE blocks, and modules never quantized.

Names are relative to a decoder layer and always the checkpoint's own tensor names: a `prepare_layer`
hook reshapes a transformers layer whose in-memory layout differs from the files (fused 3-D expert
tensors, say) into modules named as on disk, so that export writes the names the engine reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from fp8ptq.errors import ModelError
from fp8ptq.models.views import View

# The small decoder every adapter's `tiny` config starts from (tests, examples): 2 layers, 64 wide.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


@dataclass(frozen=True)
class Block:
    """One residual block of a decoder layer: x + post_norm(module(norm(x))).

    kind: "attention" (the module is called with position embeddings and a mask) or "mlp".
    final: the Linear whose output is the module's output (o_proj, down_proj): the pipeline then gets
    the block's output from that Linear's cached input, without re-running the block. None: none (MoE).
    """

    kind: Literal["attention", "mlp", "layer"]  # layer: the whole decoder layer (the generic adapter)
    norm: str
    module: str
    final: str | None = None
    post_norm: str | None = None


@dataclass(frozen=True)
class SmoothGroup:
    """SmoothQuant's unit: `norm` feeds `linears` (which share its output), so per-channel scales fold
    exactly into the norm's weight. key: the recipe's name for it (`smooth.groups`)."""

    key: str
    norm: str
    linears: tuple[str, ...]
    offset: float | None = None  # the norm computes (offset + w); None: the adapter's norm_offset


@dataclass(frozen=True)
class FlattenTarget:
    """A gated MLP down(act(gate(x)) * up(x)) whose intermediate FlattenQuant may widen (separate Linears)."""

    gate: str
    up: str
    down: str


def is_latent(attn: torch.nn.Module) -> bool:
    """An MLA attention: it caches a latent and a shared RoPE key, which `expand_kv` turns into per-head
    keys and values (every transformers 5.24 MLA module has the method)."""
    return callable(getattr(type(attn), "expand_kv", None))


@dataclass(frozen=True)
class Arch:
    """An architecture adapter. Everything is data; the hooks default to the common decoder layout."""

    name: str
    model_types: tuple[str, ...]
    blocks: tuple[Block, ...]
    fused: dict[str, tuple[str, ...]]  # vLLM's packed_modules_mapping: fused name -> shard leaf names
    smooth: tuple[SmoothGroup, ...] = ()
    flatten: FlattenTarget | None = None
    attention: str = "self_attn"  # the module whose attention function sees post-RoPE keys/values
    norm_offset: float = 0.0  # RMSNorm computes norm(x) * (norm_offset + w): 1.0 for Gemma
    expert_lists: tuple[str, ...] = ()  # ModuleLists of experts (their groups are calibrated together)
    keep_float: tuple[str, ...] = ()  # re: patterns never quantized whatever a recipe targets (routers)
    kv_cache: bool = True  # per-head post-RoPE KV scales describe the engine's cache (False: MLA's latent)
    latent_kv: bool = False  # MLA: the cache holds [latent, RoPE key] under one scale (quantization/numerics.py)
    head_pair: tuple[str, str] | None = None  # (value, output) projections: per-head rotation R2 (outliers/rotate)
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    rotary: str = "model.rotary_emb"
    tiny: dict = field(default_factory=dict)  # a small config (overrides) for tests and examples
    prepare_layer: Callable[[torch.nn.Module, object], None] | None = None  # reshape a layer (see module doc)
    embed_scale: Callable[[object], float] | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    # source tensor names -> per-module views of tensors the files store fused or split (3-D experts)
    source_views: Callable[[list[str], object], dict[str, View]] | None = None
    eager_attention: bool = False  # transformers' SDPA cannot compute the attention (gpt-oss's sinks)

    # -- where things are ---------------------------------------------------------------------------
    @property
    def final_norm(self) -> str:
        """The norm after the last decoder layer (beside the layer list: model.norm)."""
        return self.layers.rpartition(".")[0] + ".norm"

    def layer_prefix(self, index: int) -> str:
        return f"{self.layers}.{index}."

    def layer_count(self, config) -> int:
        """How many decoder layers the layer list holds (num_hidden_layers; the generic adapter counts them)."""
        return config.get_text_config().num_hidden_layers

    def decoder_layers(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return model.get_submodule(self.layers)

    def attention_of(self, layer: torch.nn.Module) -> str | None:
        """The layer-relative name of the module whose attention sees post-RoPE keys/values (None: a layer
        without a KV cache)."""
        return self.attention

    def shared_inputs(self, layer: torch.nn.Module, prefix: str) -> list[tuple[str, ...]] | None:
        """The layer's Linears grouped by the input they read, when discovered by tracing (the generic
        adapter); None: the `fused` names say which shards vLLM fuses."""
        return None

    def smooth_groups(self, layer: torch.nn.Module, prefix: str) -> tuple[SmoothGroup, ...]:
        """SmoothQuant's norm -> Linears maps of one layer (the adapter's; the generic adapter traces them)."""
        return self.smooth

    def is_layer_tensor(self, name: str) -> bool:
        return name.startswith(self.layers + ".")

    def renames(self, stored: list[str]) -> dict[str, str]:
        """Module name -> stored name where the checkpoint names a tensor otherwise: none for an adapter,
        whose skeleton uses the checkpoint's names (the generic adapter reads transformers' rules)."""
        return {}

    @property
    def described(self) -> str:
        """How messages name this layout: 'the llama adapter'."""
        return f"the {self.name} adapter"

    def refuses(self, recipe) -> str | None:
        """Why this family cannot take `recipe` (checked before any work), or None."""
        kv = recipe.scheme.kv_cache
        fp8_tensor = kv is not None and (str(kv.type), kv.num_bits, str(kv.strategy)) == ("float", 8, "tensor")
        if kv is not None and self.latent_kv and not fp8_tensor:
            return (
                f"recipe '{recipe.name}' quantizes the KV cache as {kv.type} {kv.num_bits}-bit per {kv.strategy}, "
                f"but {self.described} caches MLA's latent, one entry per token that vLLM 0.32 stores in FP8 "
                "with one scale per layer; use kv_cache {num_bits: 8, type: float, strategy: tensor}"
            )
        if kv is not None and not (self.kv_cache or self.latent_kv):
            return (
                f"recipe '{recipe.name}' quantizes the KV cache, which {self.described} does not support "
                "(its config declares MLA's compressed latent, kv_lora_rank, but no layer of it expands a "
                "latent where fp8ptq can round the engine's cache entry); use a recipe without a KV scheme "
                "(e.g. fp8-dynamic, w4a16)"
            )
        if recipe.flatten is not None and self.flatten is None:
            return (
                f"recipe '{recipe.name}' flattens the MLP, which {self.described} does not support "
                "(no separate gate/up/down Linears in every layer)"
            )
        return None

    def check_layer(self, layer: torch.nn.Module, index: int) -> None:
        """A typed error when a decoder layer lacks what this adapter runs."""
        names = dict(layer.named_modules())
        want = {n for b in self.blocks for n in (b.norm, b.module, b.post_norm) if n}
        missing = sorted(n for n in want if n not in names)
        if missing:
            raise ModelError(
                f"decoder layer {index} ({type(layer).__name__}) has no {', '.join(missing)}: not a {self.name} layer",
                fix="check config.json's model_type and architectures",
            )

    # -- the residual stream between layers (models/arch/streams.py: where it is not the embeddings) -----
    def stream_width(self, model: torch.nn.Module) -> int:
        """Values per token of the residual stream between decoder layers (the activation stores' rows)."""
        return model.config.get_text_config().hidden_size

    def enter(self, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The first layer's input for embeddings x (the embeddings themselves)."""
        return x

    def leave(self, model: torch.nn.Module, y: torch.Tensor) -> torch.Tensor:
        """The final norm's input for the last layer's output y (y itself)."""
        return y

    def stack_modules(self, model: torch.nn.Module) -> list[str]:
        """Modules beside the layers, embeddings and final norm that `enter`/`leave` run (none)."""
        return []

    # -- running a layer block by block ---------------------------------------------------------------
    def layer_inputs(self, model: torch.nn.Module, seq_len: int, device) -> Callable[[int], LayerInputs]:
        """What the model's own forward passes each decoder layer for positions 0..seq_len-1 (batch 1):
        its position embeddings (per layer type where a family has several, e.g. Gemma 3's local and
        global RoPE) and attention mask (None: plain causal; sliding-window layers get theirs). Captured
        by running the model's decoder stack on a zero input with the layers replaced by recording
        stubs, so no family's rotary or mask rules are re-derived here."""
        layers = self.decoder_layers(model)
        stack = model.get_submodule(self.layers.rpartition(".")[0])
        rotary = model.get_submodule(self.rotary)
        rotary.to(device)
        seen: dict[int, LayerInputs] = {}
        stubs = torch.nn.ModuleList(_Recorder(i, seen, len(layers)) for i in range(len(layers)))
        stack.layers = stubs
        try:
            with torch.inference_mode():
                stack(inputs_embeds=torch.zeros(1, seq_len, model.config.hidden_size, device=device), use_cache=False)
        except _Recorded:
            pass
        finally:
            stack.layers = layers
        assert len(seen) == len(layers), f"captured inputs of {len(seen)} of {len(layers)} layers"
        return seen.__getitem__

    def run_block(self, layer: torch.nn.Module, block: Block, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """x + post_norm(module(norm(x))) for one block of a layer (no KV cache)."""
        h = layer.get_submodule(block.norm)(x)
        module = layer.get_submodule(block.module)
        if block.kind == "attention":
            out = module(
                hidden_states=h, position_embeddings=inputs.position_embeddings, attention_mask=inputs.attention_mask
            )[0]
        else:
            out = module(h)
        if isinstance(out, tuple):  # MoE blocks that also return their router scores (gpt-oss)
            out = out[0]
        if block.post_norm is not None:
            out = layer.get_submodule(block.post_norm)(out)
        return x + out


@dataclass(frozen=True)
class LayerInputs:
    """The per-layer arguments of a decoder layer besides its hidden states (batch 1, broadcast)."""

    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    attention_mask: torch.Tensor | None

    def head(self, n: int) -> LayerInputs:
        """The same for the first n positions (tracing on a short slice)."""
        pos = None if self.position_embeddings is None else tuple(t[:, :n] for t in self.position_embeddings)
        mask = None if self.attention_mask is None else self.attention_mask[..., :n, :n]
        return LayerInputs(pos, mask)


class _Recorded(Exception):
    """Raised by the last recording stub: the rest of the model (final norm, head) is not needed."""


class _Recorder(torch.nn.Module):
    def __init__(self, index: int, seen: dict, total: int):
        super().__init__()
        self.index, self.seen, self.total = index, seen, total

    def forward(self, hidden_states, *args, **kwargs):
        self.seen[self.index] = LayerInputs(kwargs.get("position_embeddings"), kwargs.get("attention_mask"))
        if self.index + 1 == self.total:
            raise _Recorded
        return hidden_states
