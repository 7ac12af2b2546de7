"""What every layer of one calibration run shares, how a run is prepared, and the float observe pass.

`prepare` builds the module skeleton (no weights), the chunk plan over this rank's samples and the
activation store holding the embeddings. `observe_layer` runs a float layer over every chunk and
collects statistics on each Linear input and the post-RoPE keys/values (analysis, SmoothQuant,
FlattenQuant all read it). The layout of a layer comes from the model's architecture adapter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from fp8ptq.calibrate.store import ActivationStore
from fp8ptq.dist import ChunkPlan, LocalComm
from fp8ptq.errors import NonFiniteError
from fp8ptq.models.arch import Arch
from fp8ptq.models.arch.base import LayerInputs
from fp8ptq.models.arch.capture import cast_arguments
from fp8ptq.models.arch.generic import CapturedInputs
from fp8ptq.models.arch.tokens import reads_tokens, sample_inputs
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import build_skeleton
from fp8ptq.ops.precision import layer_dtype
from fp8ptq.outliers.stats import ActStats, StatsSpec, massive_activations
from fp8ptq.quantization.numerics import register_attention
from fp8ptq.quantization.plan import LayerPlan, plan_layer

Progress = Callable[[str, int, int], None]


class Stop(Exception):
    """Raised by a stats hook once a stage's input was seen: the rest of the block is not needed."""


@dataclass
class RunState:
    """What every layer of one calibration run shares."""

    store: ActivationStore
    chunks: ChunkPlan
    comm: object
    device: torch.device
    seq_len: int
    arch: Arch
    inputs: Callable[[int], LayerInputs]  # layer index -> its position embeddings and attention mask
    cache_bytes: int = 0  # budget for keeping a block's final Linear input between passes (0: recompute)
    compute: str = "fp32"  # the layer passes' arithmetic (ops/precision.py: fp32, tf32 or bf16)
    # image+text samples whose layers take their own arguments (calibrate/images.py): sample -> inputs
    own: dict[int, Callable[[int], LayerInputs]] = field(default_factory=dict)
    # the float model's activations beside the quantized past's (calibrate/signround.py's targets)
    float_store: ActivationStore | None = None

    def keep_float_stream(self, offload_dir) -> None:
        """Start the float model's activation stream from the store's current content (same shape)."""
        self.float_store = ActivationStore(*self.store.shape, offload_dir, device=self.store.device)
        for i in range(0, self.store.shape[0], 8):
            self.float_store.write(i, self.store.read(i, min(i + 8, self.store.shape[0])))

    def close(self) -> None:
        for store in (self.store, self.float_store):
            if store is not None:
                store.close()

    @property
    def dtype(self) -> torch.dtype:
        return layer_dtype(self.compute)

    @property
    def total_rows(self) -> int:
        return self.chunks.samples * self.seq_len

    def each_chunk(self):
        """(global chunk index, first global sample, x on device) for this rank's chunks. x may be a view
        of the store: callers compute from it and only then `write` the chunk's rows (no copy per pass)."""
        base = self.chunks.local_samples().start
        for c in self.chunks.owned():
            r = self.chunks.sample_range(c)
            yield c, r.start, self.store.read(r.start - base, r.stop - base, copy=False).to(self.device, self.dtype)

    def write(self, first_sample: int, x: torch.Tensor) -> None:
        self.store.write(first_sample - self.chunks.local_samples().start, x)

    def new_stats(self, channels: int, spec: StatsSpec) -> ActStats:
        return ActStats(spec, channels, self.total_rows, self.seq_len)

    def inputs_at(self, index: int, first: int | None) -> LayerInputs:
        """Layer `index`'s arguments for the chunk starting at sample `first` (its own, for an image+text
        sample whose layers take image-dependent masks or positions: such a sample is a chunk alone)."""
        own = self.own.get(first)
        return self.inputs(index) if own is None else own(index)

    def run_layer(self, layer: torch.nn.Module, index: int, x: torch.Tensor, first: int | None = None) -> torch.Tensor:
        """Every block of a decoder layer, in order, for the chunk starting at sample `first` (None: the
        arguments text samples share)."""
        inputs = self.inputs_at(index, first)
        for block in self.arch.blocks:
            x = self.arch.run_block(layer, block, x, inputs)
        return x


@dataclass(frozen=True)
class CalibrationSetup:
    recipe: object | None  # the Recipe; None: observe only (fp8ptq analyze)
    chunk_samples: int = 8
    device: str = "cpu"
    offload_dir: object = None  # Path: keep activations on disk
    start_layer: int = 0  # resume: layers before this are done (their output state is restored)
    cache_bytes: int = 1 << 30  # see RunState.cache_bytes; 0 with offloaded activations (RAM stays flat)
    restore: object = None  # Path of the activation checkpoint to restore (resume)
    prefetch: bool | None = None  # read layer i+1 in a thread while i calibrates; None: on a CUDA device
    compute_dtype: str = "fp32"  # the layer passes: fp32, tf32 (CUDA) or bf16 (ops/precision.py)
    images: object = None  # calibrate/images.ImageRows: samples 0..n-1 are image+text (their towers run)


def prepare(
    src: ModelSource,
    input_ids: torch.Tensor,
    setup: CalibrationSetup,
    comm=None,
    built: Callable[[torch.nn.Module], None] | None = None,
):
    """Build the skeleton, the chunk plan and the activation store holding this rank's embeddings.
    built(model) runs once the skeleton exists, before the embeddings are read (the first layer's read
    starts there, beside the embedding lookup)."""
    comm = comm or LocalComm()
    arch = src.arch
    device = torch.device(setup.device)
    model = build_skeleton(src.config, attn_implementation=register_attention())
    if built is not None:
        built(model)
    tokens = reads_tokens(arch)  # every sample's layers take their own arguments: a chunk each
    singles = input_ids.shape[0] if tokens else (0 if setup.images is None else setup.images.singles)
    chunks = ChunkPlan(input_ids.shape[0], setup.chunk_samples, comm.rank, comm.world, singles)
    local = chunks.local_samples()
    shape = (len(local), input_ids.shape[1], arch.stream_width(model))  # (streams x) hidden per token
    store = ActivationStore(*shape, setup.offload_dir, device=_store_device(device, math.prod(shape) * 4))
    inputs = arch.layer_inputs(model, input_ids.shape[1], device)
    text_inputs = inputs
    if layer_dtype(setup.compute_dtype) != torch.float32:
        inputs = _cast_inputs(inputs, layer_dtype(setup.compute_dtype), device)
    cache = 0 if setup.offload_dir is not None else setup.cache_bytes
    state = RunState(store, chunks, comm, device, input_ids.shape[1], arch, inputs, cache, setup.compute_dtype)
    if setup.restore is not None:
        store.load(setup.restore)
    if tokens:
        _token_rows(model, src, input_ids, state, text_inputs, restored=setup.restore is not None)
    elif setup.restore is None:
        # Look rows up in the stored dtype and widen only those: an fp32 copy of the whole table (113 MiB
        # for SmolLM2, 2 GiB for a 128k x 4096 vocabulary) would be the run's peak. Same values.
        table = src.tensor(f"{arch.embed}.weight").to(device)
        src.close()
        scale = arch.embed_scale(src.config) if arch.embed_scale else None
        for c in chunks.owned():
            r = chunks.sample_range(c)
            x = torch.nn.functional.embedding(input_ids[r.start : r.stop].to(device), table).float()
            state.write(r.start, arch.enter(model, x if scale is None else x * scale))
        del table
    images = setup.images
    if images is not None and (setup.restore is None or images.own_arguments):
        from fp8ptq.calibrate.images import embed

        # their first layer's input (the model's own forward, towers included; a resumed run has its
        # layers' outputs already) and, where the family's layers take them, their own arguments
        dtype = layer_dtype(setup.compute_dtype)
        for i, x, own in embed(model, src, arch, images, text_inputs, local=local, device=device):
            if setup.restore is None:
                state.write(i, x)
            if own is not None:
                own_at = own.__getitem__
                state.own[i] = own_at if dtype == torch.float32 else _cast_inputs(own_at, dtype, device)
    cal = None if setup.recipe is None else setup.recipe.calibration  # SignRound's targets, GPTAQ's inputs
    if cal is not None and (cal.rounding == "signround" or cal.gptq_float_target > 0):
        state.keep_float_stream(setup.offload_dir)
    return model, state


def _token_rows(model, src: ModelSource, input_ids: torch.Tensor, state: RunState, shared, *, restored: bool) -> None:
    """A stack whose layers' inputs depend on the tokens (models/arch/tokens.py): each local sample's
    first-layer input (unless restored) and its layers' own arguments, from the stack's own forward."""
    local = state.chunks.local_samples()
    for i, x, own in sample_inputs(state.arch, model, src, input_ids, shared, samples=local, device=state.device):
        if not restored:
            state.write(i, x)
        own_at = own.__getitem__
        state.own[i] = own_at if state.dtype == torch.float32 else _cast_inputs(own_at, state.dtype, state.device)


def _cast_inputs(inputs: Callable[[int], LayerInputs], dtype: torch.dtype, device) -> Callable[[int], LayerInputs]:
    """Position embeddings and additive masks in the passes' dtype (bf16 layers reject fp32 operands), each
    distinct tensor cast once (layers of one type share theirs; a pass asks once per chunk)."""
    done: dict[int, torch.Tensor] = {}  # id of the fp32 tensor (kept alive by `inputs`) -> its cast
    layers: dict[int, CapturedInputs] = {}  # the generic path's arguments per layer, cast once

    def cast(t):
        if t is None or not t.is_floating_point():
            return t
        if id(t) not in done:
            done[id(t)] = t.to(dtype)
        return done[id(t)]

    def get(i: int) -> LayerInputs:
        x = inputs(i)
        if isinstance(x, CapturedInputs):  # the generic path: every argument the stack passes the layer
            if i not in layers:
                short = replace(x.short, **_cast_captured(x.short, dtype, device)) if x.short is not None else None
                layers[i] = replace(x, **_cast_captured(x, dtype, device), short=short)
            return layers[i]
        pos = None if x.position_embeddings is None else tuple(cast(t) for t in x.position_embeddings)
        return LayerInputs(pos, cast(x.attention_mask))

    return get


def _cast_captured(x: CapturedInputs, dtype: torch.dtype, device) -> dict:
    args, kwargs = cast_arguments((x.args, x.kwargs), device, dtype)
    return {"args": args, "kwargs": kwargs}


def _store_device(device: torch.device, nbytes: int) -> torch.device | None:
    """The calibration device for the activation store when it is a GPU with room for 4x the store
    (the layer and a chunk's intermediates need the rest), else host RAM (None)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return device if 4 * nbytes <= free else None


def observe_layer(
    layer: torch.nn.Module,
    index: int,
    state: RunState,
    spec: StatsSpec,
    *,
    kv: bool = True,
    massive: bool = False,
    write: bool = False,
) -> dict:
    """One float pass of every block over all chunks, collecting `spec` statistics on every Linear input
    (fused shards share one entry), post-RoPE keys/values and, optionally, massive activations in the
    residual stream. write=True stores the layer's output (analysis: nothing is quantized)."""
    modules = dict(layer.named_modules())
    stats: dict[str, ActStats] = {}
    current = {}
    handles = []

    def hook(name):
        def fn(_m, args):
            x = args[0]
            if x.dim() == 2:  # an expert's routed tokens [n, channels]: one pseudo-sample
                x = x.unsqueeze(0)
            if name not in stats:
                stats[name] = state.new_stats(x.shape[-1], spec)
            stats[name].update(current["chunk"], current["first"], x)

        return fn

    # every Linear, fused shards once (they read the same input): the first shard of each group
    prefix = state.arch.layer_prefix(index)
    for group in plan_layer(layer, prefix, ("Linear",), (), state.arch).groups:
        handles.append(modules[group[0]].register_forward_pre_hook(hook(group[0])))
    attn_name = state.arch.attention_of(layer)
    attn = modules[attn_name] if attn_name is not None else torch.nn.Module()
    if kv and attn_name is not None:
        head = attn.head_dim

        def kv_hook(_m, k, v):
            for key, t in (("k", k), ("v", v)):
                if key not in stats:
                    stats[key] = state.new_stats(t.shape[1] * head, spec)
                stats[key].update(current["chunk"], current["first"], t.transpose(1, 2).flatten(2))
            return k, v

        attn.fp8ptq_kv_hook = kv_hook
    found: list = []
    try:
        with torch.inference_mode():
            for c, first, x in state.each_chunk():
                current.update(chunk=c, first=first)
                x = state.run_layer(layer, index, x, first)
                if massive:
                    found.extend(massive_activations(x, first))
                if write:
                    state.write(first, x)
    finally:
        for h in handles:
            h.remove()
        attn.__dict__.pop("fp8ptq_kv_hook", None)
    out = {n: s.reduce(state.comm) for n, s in sorted(stats.items())}
    for n, s in out.items():
        if not bool(torch.isfinite(s.channel_amax).all()):
            raise NonFiniteError(
                f"the float activations at the input of {prefix}{n} are not finite: "
                "the model overflows on this data in fp32",
                fix="check the model's weights and the calibration data (a tensor with huge values?)",
            )
    if massive:
        merged = [m for part in state.comm.gather_objects(found) for m in part]
        out["massive"] = sorted(merged, key=lambda m: -m["abs"])[:8]
    return out


def finite_stats(where: str, amax: float, H: torch.Tensor | None = None) -> None:
    """Calibration statistics must be finite: a NaN/inf activation would become a NaN scale."""
    if not math.isfinite(amax) or (H is not None and not bool(torch.isfinite(H).all())):
        raise NonFiniteError(
            f"the calibration activations at the input of {where} are not finite (abs-max {amax}): "
            "the model overflows on this data in fp32",
            fix="check the model's weights and the calibration data (a tensor with huge values?)",
        )


def describe(scheme) -> str:
    """'FP8 per-tensor, float acts static' and the like (manifest and report)."""
    w, acts = scheme.weights, scheme.input_activations
    kind = ("FP" if w.type == "float" else "INT") + str(w.num_bits)
    text = f"{kind} per-{w.strategy}" + (f" g{w.group_size}" if w.group_size else "") + ("" if w.symmetric else " asym")
    return text + ("" if acts is None else f", {acts.type} acts {'dynamic' if acts.dynamic else 'static'}")


@dataclass(frozen=True)
class LayerHooks:
    """What a run adds to each layer's calibration (runs/calibrated.py)."""

    # schemes(i, plan) -> {group: LinearScheme}; None: the recipe's scheme for every group (mixed recipes differ)
    schemes: Callable[[int, LayerPlan], dict] | None = None
    # transforms(layer, i, state, result): exact float transforms applied before quantization (smooth, rotate)
    transforms: Callable | None = None
