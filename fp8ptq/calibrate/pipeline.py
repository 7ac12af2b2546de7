"""Sequential, chunked, staged calibration: one decoder layer at a time, inputs from the quantized past.

A Llama-family decoder layer is two residual blocks: h + attn(norm1(h)) and h + mlp(norm2(h)). For
each block, the targeted Linears form fused groups in execution order (q/k/v, o; gate/up, down), and
the KV cache sits between q/k/v and o. Each group is one *stage*:

  1. stats pass: run the block over every calibration chunk with everything upstream already
     quantized, stop at the group's input, and collect its statistics (abs-max, optional row
     subsample) and, for GPTQ, the per-chunk Hessian partials 2 X^T X;
  2. reduce the statistics across chunks and ranks (fp8ptq/dist.py: exact, split-independent);
  3. choose the static input scale, quantize the group's weights (RTN or GPTQ), and install the
     engine's input quantizer on the group, so later stages see what the engine will compute.

After the last stage the block runs once more over all chunks to produce the next block's input,
written back to the activation store. Memory is one layer + one chunk's intermediates + the store
(in RAM or on disk), whatever the depth; the math does not depend on the chunking or on the number of
ranks (maxima are exact, sums use a fixed tree). Optional exact transforms (SmoothQuant folding,
FlattenQuant channel splitting) run first, from an observe pass over the float layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from fp8ptq.calibrate.observers import OBSERVER_STATS, OBSERVERS
from fp8ptq.calibrate.store import ActivationStore
from fp8ptq.dist import ChunkPlan, LocalComm, TreeSum
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import build_skeleton, decoder_layers, materialize, release
from fp8ptq.outliers.stats import ActStats, StatsSpec, massive_activations
from fp8ptq.quantize.numerics import register_attention
from fp8ptq.quantize.plan import LayerPlan, plan_layer
from fp8ptq.quantize.schemes import FP8_GRID, LinearScheme, act_grid, input_quantizer, quantize_group
from fp8ptq.recipe import Recipe

Progress = Callable[[str, int, int], None]
BLOCKS = ("attn", "mlp")


class _Stop(Exception):
    """Raised by a stats hook once the stage's input was seen: the rest of the block is not needed."""


@dataclass
class QuantizedLinear:
    """One Linear's result: fake-quant weight (fp32, on its grid), export params and scheme."""

    weight: torch.Tensor
    params: dict[str, torch.Tensor]  # weight_scale [, weight_zero_point] [, input_scale]
    scheme: LinearScheme
    report: dict


@dataclass
class LayerResult:
    index: int
    prefix: str
    linears: dict[str, QuantizedLinear] = field(default_factory=dict)  # full module name -> result
    kv_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # full tensor name -> scale
    float_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # changed by transforms, kept float
    # module name -> (its checkpoint tensors, already in compressed-tensors form; report): data-free FP8
    packed: dict[str, tuple[dict[str, torch.Tensor], dict]] = field(default_factory=dict)
    report: dict = field(default_factory=dict)


@dataclass
class RunState:
    """What every layer of one calibration run shares."""

    store: ActivationStore
    chunks: ChunkPlan
    comm: object
    device: torch.device
    seq_len: int
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    cache_bytes: int = 0  # budget for keeping a block's final Linear input between passes (0: recompute)

    @property
    def total_rows(self) -> int:
        return self.chunks.samples * self.seq_len

    def each_chunk(self):
        """(global chunk index, first global sample, x on device) for this rank's chunks."""
        base = self.chunks.local_samples().start
        for c in self.chunks.owned():
            r = self.chunks.sample_range(c)
            yield c, r.start, self.store.read(r.start - base, r.stop - base).to(self.device)

    def write(self, first_sample: int, x: torch.Tensor) -> None:
        self.store.write(first_sample - self.chunks.local_samples().start, x)

    def new_stats(self, channels: int, spec: StatsSpec) -> ActStats:
        return ActStats(spec, channels, self.total_rows, self.seq_len)


def hessian_partial(x: torch.Tensor) -> torch.Tensor:
    """2 X^T X (fp32) of one chunk's rows x [..., in]; summed over chunks in a fixed tree."""
    rows = x.reshape(-1, x.shape[-1]).float()
    return 2.0 * (rows.T @ rows)


def run_block(layer: torch.nn.Module, block: str, x: torch.Tensor, state: RunState) -> torch.Tensor:
    """x + block(norm(x)) for the Llama-family decoder layer (see module doc)."""
    if block == "attn":
        out = layer.self_attn(hidden_states=layer.input_layernorm(x), position_embeddings=state.position_embeddings,
                              attention_mask=None)[0]
    else:
        out = layer.mlp(layer.post_attention_layernorm(x))
    return x + out


def check_layer_structure(layer: torch.nn.Module) -> None:
    missing = [n for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp") if not hasattr(layer, n)]
    assert not missing, f"decoder layer {type(layer).__name__} lacks {missing}: not a Llama-family layer"


class LayerCalibrator:
    """Calibrates and quantizes one decoder layer in stages (see module doc)."""

    def __init__(self, layer: torch.nn.Module, plan: LayerPlan, recipe: Recipe, schemes: dict[tuple, LinearScheme],
                 state: RunState, result: LayerResult):
        self.layer, self.plan, self.recipe, self.schemes, self.state, self.result = layer, plan, recipe, schemes, state, result
        self.modules = dict(layer.named_modules())
        self.attn_name = next(n for n, m in layer.named_modules() if n.endswith("self_attn"))
        self.handles: list = []
        self._last: tuple | None = None  # (input, quantized input): fused shards see the same tensor
        self._caching, self._cached = None, {}

    # -- stage order ---------------------------------------------------------------------------------
    def stage_order(self) -> dict[str, list]:
        """Groups (and 'kv') per block in execution order, traced on a 4-token slice of one sample."""
        order: dict[str, list] = {b: [] for b in BLOCKS}
        current = {"block": None}
        first_of = {g[0]: g for g in self.plan.groups}
        handles = [self.modules[n].register_forward_pre_hook(
            lambda _m, _a, g=g: order[current["block"]].append(g)) for n, g in first_of.items()]
        attn = self.modules[self.attn_name]
        attn.fp8ptq_kv_hook = lambda _m, k, v: (order[current["block"]].append("kv"), (k, v))[1]
        x = self.state.store.read(0, 1)[:, :4].to(self.state.device)  # every rank owns samples (checked)
        saved = self.state.position_embeddings
        self.state.position_embeddings = tuple(t[:, :4] for t in saved)
        try:
            with torch.inference_mode():
                for block in BLOCKS:
                    current["block"] = block
                    run_block(self.layer, block, x, self.state)
        finally:
            self.state.position_embeddings = saved
            for h in handles:
                h.remove()
            attn.__dict__.pop("fp8ptq_kv_hook", None)
        if self.recipe.scheme.kv_cache is None:
            order["attn"] = [g for g in order["attn"] if g != "kv"]
        return order

    # -- passes --------------------------------------------------------------------------------------
    def _pass(self, block: str, write: bool = False) -> None:
        """Run `block` over every local chunk; a _Stop from a hook ends that chunk early."""
        with torch.inference_mode():
            for c, first, x in self.state.each_chunk():
                self.chunk = (c, first)
                try:
                    y = run_block(self.layer, block, x, self.state)
                except _Stop:
                    continue
                if write:
                    self.state.write(first, y)

    def _stage_stats(self, block: str, group, spec: StatsSpec, h_fn: Callable | None):
        """Statistics of `group`'s input over all chunks, and the Hessian partials of h_fn(input) when
        h_fn is given (identity, or the engine's input quantizer when it needs no global statistic)."""
        stats = self.state.new_stats(self.modules[group[0]].in_features, spec)
        tree = TreeSum() if h_fn is not None else None

        keep = self._caching == group  # the block's final Linear: keep its input for the output pass

        def hook(_m, args):
            c, first = self.chunk
            stats.update(c, first, args[0])
            if tree is not None:
                tree.add(c, hessian_partial(h_fn(args[0])))
            if keep:
                self._cached[c] = args[0].clone()
            raise _Stop

        self._run_hooked(block, group[0], hook)
        return stats.reduce(self.state.comm), (None if tree is None else tree.total(self.state.comm))

    def _hessian_pass(self, block: str, group, quant: Callable) -> torch.Tensor:
        tree = TreeSum()

        def hook(_m, args):
            tree.add(self.chunk[0], hessian_partial(quant(args[0])))
            raise _Stop

        self._run_hooked(block, group[0], hook)
        return tree.total(self.state.comm)

    def _run_hooked(self, block: str, module: str, hook) -> None:
        h = self.modules[module].register_forward_pre_hook(hook)
        try:
            self._pass(block)
        finally:
            h.remove()

    # -- stages --------------------------------------------------------------------------------------
    def quantize_stage(self, block: str, group) -> None:
        scheme = self.schemes[group]
        cal = self.recipe.calibration
        acts = scheme.input_activations
        static = acts is not None and not acts.dynamic
        quant = input_quantizer(acts, None) if acts is not None and acts.dynamic else None
        # GPTQ's Hessian comes from the inputs the engine sees (quantized) when asked; a static scale
        # is only known after the stats pass, which then costs one more pass to the group's input.
        quant_h = cal.gptq_quantized_inputs and acts is not None
        h_fn = None
        if cal.weight_method == "gptq" and not (quant_h and static):
            h_fn = quant if (quant_h and quant is not None) else (lambda t: t)
        spec = OBSERVER_STATS[cal.observer] if static else StatsSpec()
        stats, H = self._stage_stats(block, group, spec, h_fn)
        choice = None
        if static:
            choice = OBSERVERS[cal.observer](stats, act_grid(acts))
            quant = input_quantizer(acts, choice.scale)
            if cal.weight_method == "gptq" and quant_h:
                H = self._hessian_pass(block, group, quant)
        weights = {n: self.modules[n].weight.data for n in group}
        for name, qw in quantize_group(weights, scheme.weights, cal, H).items():
            self.modules[name].weight.data = qw.fake.to(self.modules[name].weight.dtype)
            params = dict(qw.params)
            report = dict(qw.report, input_amax=stats.amax, scheme=scheme.weights.describe()
                          + ("" if acts is None else f", {acts.type} acts {'dynamic' if acts.dynamic else 'static'}"))
            if choice is not None:
                params["input_scale"] = choice.scale
                report["input_clip_ratio"] = choice.clip_ratio
            self.result.linears[self.plan.prefix + name] = QuantizedLinear(qw.fake, params, scheme, report)
        if quant is not None:
            self._install_input_quant(group, quant)

    def _install_input_quant(self, group, quant: Callable) -> None:
        def hook(_m, args):
            x = args[0]
            if self._last is None or self._last[0] is not x:
                self._last = None  # drop the previous pair before allocating the next
                self._last = (x, quant(x))
            return (self._last[1], *args[1:])

        for n in group:
            self.handles.append(self.modules[n].register_forward_pre_hook(hook))

    def quantize_kv(self) -> None:
        """Post-RoPE keys and values: static per-layer FP8 scales, then the KV quantizer is installed."""
        attn = self.modules[self.attn_name]
        stats: dict[str, ActStats] = {}

        def observe(_m, k, v):
            c, first = self.chunk
            for key, t in (("k", k), ("v", v)):  # [n, kv_heads, seq, head] -> [n, seq, kv_heads*head]
                t = t.transpose(1, 2).flatten(2)
                stats.setdefault(key, self.state.new_stats(t.shape[-1], StatsSpec())).update(c, first, t)
            raise _Stop

        attn.fp8ptq_kv_hook = observe
        try:
            self._pass("attn")
        finally:
            attn.__dict__.pop("fp8ptq_kv_hook", None)
        # KV rows are not subsampled: minmax (clipping hurts FP8's flat relative error, see BENCHMARKS)
        kc, vc = (OBSERVERS["minmax"](stats[key].reduce(self.state.comm), FP8_GRID) for key in ("k", "v"))
        prefix = self.plan.prefix + self.attn_name
        self.result.kv_scales[f"{prefix}.k_scale"] = kc.scale
        self.result.kv_scales[f"{prefix}.v_scale"] = vc.scale
        self.result.report["kv"] = {"k_amax": kc.amax, "v_amax": vc.amax}
        kv = self.recipe.scheme.kv_cache
        kq, vq = input_quantizer(kv, kc.scale), input_quantizer(kv, vc.scale)
        attn.fp8ptq_kv_hook = lambda _m, k, v: (kq(k), vq(v))

    def run(self, order: dict[str, list]) -> None:
        for block in BLOCKS:
            last = order[block][-1] if order[block] else None
            # A block's output is x + final_linear(its input) (o_proj / down_proj in Llama-family layers),
            # so the input cached by the final stage's stats pass gives the output without recomputing
            # the block (28% fewer FLOPs) -- when that input fits the cache budget.
            final = {"attn": "o_proj", "mlp": "down_proj"}[block]
            cacheable = (last not in (None, "kv") and len(last) == 1 and last[0].endswith(final)
                         and self._cache_fits(self.modules[last[0]].in_features))
            self._caching, self._cached = (last if cacheable else None), {}
            for stage in order[block]:
                if stage == "kv":
                    self.quantize_kv()
                else:
                    self.quantize_stage(block, stage)
            if self._caching is not None:
                self._output_from_cache(self.modules[last[0]])
            else:
                self._pass(block, write=True)
            self._caching, self._cached = None, {}

    def _cache_fits(self, width: int) -> bool:
        tokens = len(self.state.chunks.local_samples()) * self.state.seq_len
        return self.state.cache_bytes > 0 and tokens * width * 4 <= self.state.cache_bytes

    def _output_from_cache(self, final: torch.nn.Module) -> None:
        with torch.inference_mode():
            for c, first, x in self.state.each_chunk():
                self.state.write(first, x + final(self._cached.pop(c)))  # module call: its quant hook runs

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.modules[self.attn_name].__dict__.pop("fp8ptq_kv_hook", None)
        self._last = None


def observe_layer(layer: torch.nn.Module, prefix: str, state: RunState, spec: StatsSpec, *, kv: bool = True,
                  massive: bool = False, write: bool = False) -> dict:
    """One float pass of both blocks over all chunks, collecting `spec` statistics on every Linear input
    (fused shards share one entry), post-RoPE keys/values and, optionally, massive activations in the
    residual stream. write=True stores the layer's output (analysis: nothing is quantized)."""
    modules = dict(layer.named_modules())
    stats: dict[str, ActStats] = {}
    current = {}
    handles = []

    def hook(name):
        def fn(_m, args):
            x = args[0]
            if name not in stats:
                stats[name] = state.new_stats(x.shape[-1], spec)
            stats[name].update(current["chunk"], current["first"], x)

        return fn

    # every Linear, fused shards once (they read the same input): the first shard of each group
    for group in plan_layer(layer, prefix, ("Linear",), ()).groups:
        handles.append(modules[group[0]].register_forward_pre_hook(hook(group[0])))
    attn_name = next(n for n in modules if n.endswith("self_attn"))
    attn = modules[attn_name]
    if kv:
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
                for block in BLOCKS:
                    x = run_block(layer, block, x, state)
                if massive:
                    found.extend(massive_activations(x, first))
                if write:
                    state.write(first, x)
    finally:
        for h in handles:
            h.remove()
        attn.__dict__.pop("fp8ptq_kv_hook", None)
    out = {n: s.reduce(state.comm) for n, s in sorted(stats.items())}
    if massive:
        merged = [m for part in state.comm.gather_objects(found) for m in part]
        out["massive"] = sorted(merged, key=lambda m: -m["abs"])[:8]
    return out


@dataclass(frozen=True)
class CalibrationSetup:
    recipe: Recipe | None  # None: observe only (fp8ptq analyze)
    chunk_samples: int = 8
    device: str = "cpu"
    offload_dir: object = None  # Path: keep activations on disk
    start_layer: int = 0  # resume: layers before this are done (their output state is restored)
    cache_bytes: int = 1 << 30  # see RunState.cache_bytes; 0 with offloaded activations (RAM stays flat)
    restore: object = None  # Path of the activation checkpoint to restore (resume)


def prepare(src: ModelSource, input_ids: torch.Tensor, setup: CalibrationSetup, comm=None):
    """Build the skeleton, the chunk plan and the activation store holding this rank's embeddings."""
    comm = comm or LocalComm()
    device = torch.device(setup.device)
    model = build_skeleton(src.config, attn_implementation=register_attention())
    chunks = ChunkPlan(input_ids.shape[0], setup.chunk_samples, comm.rank, comm.world)
    local = chunks.local_samples()
    store = ActivationStore(len(local), input_ids.shape[1], src.config.hidden_size, setup.offload_dir)
    rotary = model.model.rotary_emb.to(device)
    pos_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0)
    probe = torch.zeros(1, 1, src.config.hidden_size, device=device)
    with torch.inference_mode():
        pos = rotary(probe, pos_ids)
    cache = 0 if setup.offload_dir is not None else setup.cache_bytes
    state = RunState(store, chunks, comm, device, input_ids.shape[1], pos, cache)
    if setup.restore is not None:
        store.load(setup.restore)
    else:
        # Look rows up in the stored dtype and widen only those: an fp32 copy of the whole table (113 MiB
        # for SmolLM2, 2 GiB for a 128k x 4096 vocabulary) would be the run's peak. Same values.
        table = src.tensor("model.embed_tokens.weight").to(device)
        src.close()
        for c in chunks.owned():
            r = chunks.sample_range(c)
            state.write(r.start, torch.nn.functional.embedding(input_ids[r.start : r.stop].to(device), table).float())
        del table
    return model, state


def calibrate(src: ModelSource, recipe: Recipe, input_ids: torch.Tensor, on_layer: Callable[[LayerResult, RunState], None],
              progress: Progress | None = None, setup: CalibrationSetup | None = None, comm=None,
              layer_schemes: Callable[[int, LayerPlan], dict] | None = None,
              transforms: Callable | None = None) -> None:
    """Sequential calibration. `on_layer(result, state)` receives each finished layer (then it is freed).
    layer_schemes(i, plan) -> {group: LinearScheme} (default: the recipe's scheme for every group);
    transforms(layer, i, prefix, state, result): exact float transforms applied before quantization."""
    setup = setup or CalibrationSetup(recipe)
    model, state = prepare(src, input_ids, setup, comm)
    layers = decoder_layers(model)
    default = LinearScheme(recipe.scheme.weights, recipe.scheme.input_activations)
    try:
        for i in range(setup.start_layer, len(layers)):
            layer, prefix = layers[i], f"model.layers.{i}."
            check_layer_structure(layer)
            materialize(layer, prefix, src, torch.float32, state.device)
            src.close()  # drop mmaps: file pages touched would otherwise stay in RSS, growing with depth
            result = LayerResult(index=i, prefix=prefix)
            if transforms is not None:
                transforms(layer, i, prefix, state, result)
            plan = plan_layer(layer, prefix, recipe.scheme.targets, recipe.scheme.ignore)
            result.report["skipped"] = {prefix + n: why for n, why in plan.skipped}
            schemes = layer_schemes(i, plan) if layer_schemes else {g: default for g in plan.groups}
            cal = LayerCalibrator(layer, plan, recipe, schemes, state, result)
            try:
                cal.run(cal.stage_order())
            finally:
                cal.close()
            on_layer(result, state)
            release(layer)
            if progress:
                progress("calibrate", i + 1, len(layers))
    finally:
        state.store.close()
