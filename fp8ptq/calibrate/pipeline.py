"""Sequential, chunked, staged calibration: one decoder layer at a time, inputs from the quantized past.

A decoder layer is a sequence of residual blocks, x + post(module(norm(x))), as its architecture adapter describes
(models/arch/). For each block, the targeted Linears form fused groups in execution order (q/k/v, o; gate/up, down for
a Llama layer), and the KV cache sits between the attention's input projections and its output projection. Each group
is one *stage*: (1) a stats pass runs the block over every chunk with everything upstream already quantized, stops at
the group's input and collects its statistics (abs-max, optional row subsample) and, for GPTQ, the per-chunk Hessian
partials 2 X^T X; (2) they are reduced across chunks and ranks (fp8ptq/dist.py: exact, split-independent); (3) the
static input scale is chosen, the group's weights quantized (RTN or GPTQ) and the engine's input quantizer installed,
so later stages see what the engine will compute. `rounding: signround` then refines the block's groups together on its
output error (calibrate/signround.py), through input and KV quantizers that pass the gradient straight through.

After the last stage the block runs once more over all chunks to produce the next block's input, written back to the
activation store. Memory is one layer + one chunk's intermediates + the store (in RAM or on disk), whatever the depth;
the math does not depend on the chunking or on the number of ranks (maxima are exact, sums use a fixed tree). Optional
exact transforms (SmoothQuant folding, FlattenQuant channel splitting) run first, from an observe pass over the float
layer.
"""

from __future__ import annotations

from typing import Callable

import torch

from fp8ptq.calibrate.experts import ExpertStage, merge_expert_stages, quantize_expert_stage
from fp8ptq.calibrate.gptaq import GroupHessian, toward_float
from fp8ptq.calibrate.kv import quantize_kv
from fp8ptq.calibrate.observers import OBSERVER_STATS, OBSERVERS
from fp8ptq.calibrate.replay import Replay
from fp8ptq.calibrate.signround import float_targets, refine_block
from fp8ptq.calibrate.state import (
    CalibrationSetup,
    LayerHooks,
    Progress,
    RunState,
    Stop,
    describe,
    finite_stats,
    prepare,
)
from fp8ptq.models.arch import Block
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.prefetch import LayerPrefetch
from fp8ptq.models.skeleton import materialize, release
from fp8ptq.ops.precision import pass_precision
from fp8ptq.outliers.stats import StatsSpec
from fp8ptq.quantization.numerics import clear_kv_hook, input_quantizer, set_kv_hook, straight_through
from fp8ptq.quantization.plan import LayerPlan, plan_layer
from fp8ptq.quantization.results import LayerResult, QuantizedLinear
from fp8ptq.quantization.schemes import LinearScheme, calibrated_inputs, dynamic_inputs, handler
from fp8ptq.quantization.weights import solve_group, split_group


class LayerCalibrator:
    """Calibrates and quantizes one decoder layer in stages (see module doc)."""

    def __init__(
        self,
        layer: torch.nn.Module,
        index: int,
        plan: LayerPlan,
        *,
        recipe,
        schemes: dict[tuple, LinearScheme],
        state: RunState,
        result: LayerResult,
    ):
        self.layer, self.index, self.plan, self.recipe = layer, index, plan, recipe
        self.schemes, self.state, self.result = schemes, state, result
        self.arch = state.arch
        self.inputs = state.inputs(index)
        self.modules = dict(layer.named_modules())
        self.attn_name = self.arch.attention_of(layer)  # None: no KV cache in this layer (hybrid stacks)
        self.handles: list = []
        self._last: tuple | None = None  # (input, quantized input): fused shards see the same tensor
        self._caching, self._cached = None, {}
        self.routes: dict[str, list[int]] = {}  # experts path -> routed tokens per expert (calibrate/experts.py)
        self.solved, self.refining = [], False  # block's (group, SolvedGroup, H, amax, input scale) to refine
        self.float_inputs: dict = {}  # group -> chunk -> the float model's input (calibrate/gptaq.py)
        tokens = len(state.chunks.local_samples()) * state.seq_len
        self.replay = Replay(self.modules, 0, tokens)  # calibrate/replay.py

    def _run_block(self, block: Block, x: torch.Tensor, inputs=None) -> torch.Tensor:
        return self.arch.run_block(self.layer, block, x, self.inputs if inputs is None else inputs)

    # -- stage order ---------------------------------------------------------------------------------
    def stage_order(self) -> list[list]:
        """Groups (and 'kv') per block in execution order, traced on a 4-token slice of one sample."""
        order: list[list] = [[] for _ in self.arch.blocks]
        current = {"block": 0}
        first_of = {g[0]: g for g in self.plan.groups}
        handles = [
            self.modules[n].register_forward_pre_hook(lambda _m, _a, g=g: order[current["block"]].append(g))
            for n, g in first_of.items()
        ]
        attn = self.modules[self.attn_name] if self.attn_name is not None else torch.nn.Module()
        set_kv_hook(attn, lambda _m, k, v: (order[current["block"]].append("kv"), (k, v))[1])
        x = self.state.store.read(0, 1)[:, :4].to(self.state.device, self.state.dtype)  # every rank owns samples
        head = self.inputs.head(4)
        try:
            with torch.inference_mode():
                for b, block in enumerate(self.arch.blocks):
                    current["block"] = b
                    self._run_block(block, x, head)
        finally:
            for h in handles:
                h.remove()
            clear_kv_hook(attn)
        if self.recipe.scheme.kv_cache is None:
            order = [[g for g in stages if g != "kv"] for stages in order]
        return merge_expert_stages(order, self.plan, self.arch)

    # -- passes --------------------------------------------------------------------------------------
    def _pass(self, block: Block, write: bool = False) -> None:
        """Run `block` over every local chunk; a Stop from a hook ends that chunk early."""
        with torch.inference_mode(), self.replay.during_pass() as seen, self._precision():
            for c, first, x in self.state.each_chunk():
                self.chunk = (c, first)
                self.replay.at = c
                seen.add(c)
                try:
                    y = self._run_block(block, x, self.state.inputs_at(self.index, first))
                except Stop:
                    continue
                if write:
                    self.state.write(first, y)

    def _precision(self):
        return pass_precision(self.state.compute, self.state.device)

    def _stage_stats(self, block: Block, group, spec: StatsSpec, h_fn: Callable | None):
        """Statistics of `group`'s input over all chunks, and the Hessian partials of h_fn(input) when
        h_fn is given (identity, or the engine's input quantizer when it needs no global statistic), with
        the float-target cross term where the float pass recorded the group's inputs (else None)."""
        stats = self.state.new_stats(self.modules[group[0]].in_features, spec)
        hess = GroupHessian(self.float_inputs, group) if h_fn is not None else None

        keep = self._caching == group  # the block's final Linear: keep its input for the output pass

        def hook(_m, args):
            c, first = self.chunk
            stats.update(c, first, args[0])
            if hess is not None:
                hess.add(c, h_fn(args[0]))
            if keep:  # no copy: the pass stops here, so nothing writes to this input afterwards
                self._cached[c] = args[0]
            raise Stop

        self._run_hooked(block, group[0], hook)
        comm = self.state.comm
        return stats.reduce(comm), *((None, None) if hess is None else hess.total(comm))

    def _hessian_pass(self, block: Block, group, quant: Callable) -> tuple[torch.Tensor, torch.Tensor | None]:
        hess = GroupHessian(self.float_inputs, group)

        def hook(_m, args):
            hess.add(self.chunk[0], quant(args[0]))
            raise Stop

        self._run_hooked(block, group[0], hook)
        return hess.total(self.state.comm)

    def _run_hooked(self, block: Block, module: str, hook) -> None:
        h = self.modules[module].register_forward_pre_hook(hook)
        try:
            self._pass(block)
        finally:
            h.remove()

    # -- stages --------------------------------------------------------------------------------------
    def quantize_stage(self, block: Block, group) -> None:
        scheme = self.schemes[group]
        cal = self.recipe.calibration
        acts = scheme.input_activations
        static = calibrated_inputs(acts)
        quant = input_quantizer(acts, None) if dynamic_inputs(acts) else None
        # GPTQ's Hessian comes from the inputs the engine sees (quantized) when asked; a static scale
        # is only known after the stats pass, which then costs one more pass to the group's input.
        quant_h = cal.gptq_quantized_inputs and acts is not None
        h_fn = None
        if cal.weight_method == "gptq" and not (quant_h and static):
            h_fn = quant if (quant_h and quant is not None) else (lambda t: t)
        spec = OBSERVER_STATS[cal.observer] if static else StatsSpec()
        stats, H, D = self._stage_stats(block, group, spec, h_fn)
        finite_stats(self.plan.prefix + group[0], stats.amax, H)
        choice = None
        if static:
            choice = OBSERVERS[cal.observer](stats, handler(acts).act_grid(acts))
            quant = input_quantizer(acts, choice.scale)
            if cal.weight_method == "gptq" and quant_h:
                H, D = self._hessian_pass(block, group, quant)
        weights = {n: self.modules[n].weight.data.float() for n in group}  # bf16 passes: solved in fp32
        weights = toward_float(weights, D, H, cal)  # calibration.gptq_float_target
        weight_only = scheme.input_activations is None
        solved = (group, solve_group(weights, scheme.weights, cal, H, weight_only), H, stats.amax, choice)
        self.solved += [solved] if self.refining else []  # kept for the block's rounding (calibrate/signround.py)
        self.install(*solved)
        if quant is not None:
            self._install_input_quant(group, quant)

    def install(self, group, solved, H, amax, choice) -> None:
        """A solved group's shards on the modules and into the layer's result."""
        scheme = self.schemes[group]
        for name, qw in split_group(solved, H).items():
            self.modules[name].weight.data = qw.fake.to(self.modules[name].weight.dtype)
            params = dict(qw.params)
            report = dict(qw.report, input_amax=amax, scheme=describe(scheme))
            if choice is not None:
                params["input_scale"] = choice.scale
                report["input_clip_ratio"] = choice.clip_ratio
            self.result.linears[self.plan.prefix + name] = QuantizedLinear(qw.fake, params, scheme, report)

    def _install_input_quant(self, group, quant: Callable) -> None:
        quant = straight_through(quant)  # rounding steps (signround.py): a straight-through gradient

        def hook(_m, args):
            if _m in self.replay.active:  # its output is replayed: its input is not needed
                return None
            x = args[0]
            if self._last is None or self._last[0] is not x:
                self._last = None  # drop the previous pair before allocating the next
                self._last = (x, quant(x))
            return (self._last[1], *args[1:])

        for n in group:
            self.handles.append(self.modules[n].register_forward_pre_hook(hook))

    def run(self, order: list[list]) -> None:
        for block, stages in zip(self.arch.blocks, order):
            last = stages[-1] if stages else None
            # A block's output is x + post(final_linear(its input)) (o_proj / down_proj in a Llama layer),
            # so the input cached by the final stage's stats pass gives the output without recomputing
            # the block (28% fewer FLOPs) -- when that input fits the cache budget.
            refine = self.refining = self.recipe.calibration.rounding == "signround" and tuple in map(type, stages)
            cacheable = (
                not refine  # the final Linear's input changes when the groups before it are refined
                and block.final is not None
                and last == (block.final,)
                and self._cache_fits(self.modules[block.final].in_features)
            )
            self._caching, self._cached = (last if cacheable else None), {}
            self._plan_replay(block, stages, cacheable)
            # the float model's block output (SignRound's targets) and its groups' inputs (gptq_float_target)
            targets, self.solved = float_targets(self, block, stages), []
            for k, stage in enumerate(stages):
                if stage == "kv":
                    quantize_kv(self, block)
                elif isinstance(stage, ExpertStage):
                    quantize_expert_stage(self, block, stage)
                else:
                    self.quantize_stage(block, stage)
                    # a quantized group is final: worth recording when two more passes run through it
                    if self.replay.budget and len(stages) - k - 1 + (not cacheable) >= 2:
                        self.replay.want(stage, lambda n: self.modules[n].out_features)
            if refine:
                refine_block(self, block, targets)  # calibrate/signround.py
                targets = self.solved = None
            if self._caching is not None:
                self._output_from_cache(block)
            else:
                self._pass(block, write=True)
            self._caching, self._cached, self.float_inputs = None, {}, {}
            self.replay.clear()

    def _plan_replay(self, block: Block, stages: list, cacheable: bool) -> None:
        """Replay budget for this block (what the final Linear's cache leaves) and the norm's recording."""
        self.replay.clear()
        self.replay.budget = 0
        if any(isinstance(s, ExpertStage) for s in stages):
            return  # MoE blocks: passes over expert batches; not replayed
        final = self.replay.tokens * self.modules[block.final].in_features * 4 if cacheable else 0
        self.replay.budget = max(0, self.state.cache_bytes - final)
        if block.norm and len(stages) + (not cacheable) >= 2:
            self.replay.want([block.norm], lambda _n: self.state.store.shape[-1])

    def _cache_fits(self, width: int) -> bool:
        tokens = len(self.state.chunks.local_samples()) * self.state.seq_len
        return self.state.cache_bytes > 0 and tokens * width * 4 <= self.state.cache_bytes

    def _output_from_cache(self, block: Block) -> None:
        final = self.modules[block.final]
        post = self.modules[block.post_norm] if block.post_norm else (lambda t: t)
        with torch.inference_mode(), self._precision():
            for c, first, x in self.state.each_chunk():
                self.state.write(first, x + post(final(self._cached.pop(c))))  # module call: its quant hook runs

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        if self.attn_name is not None:
            clear_kv_hook(self.modules[self.attn_name])
        self._last = None


def calibrate(
    src: ModelSource,
    recipe,
    input_ids: torch.Tensor,
    on_layer: Callable[[LayerResult, RunState], None],
    *,
    progress: Progress | None = None,
    setup: CalibrationSetup | None = None,
    comm=None,
    hooks: LayerHooks = LayerHooks(),
) -> None:
    """Sequential calibration. `on_layer(result, state)` receives each finished layer (then it is freed)."""
    layer_schemes, transforms = hooks.schemes, hooks.transforms
    setup = setup or CalibrationSetup(recipe)
    cuda = torch.device(setup.device).type == "cuda"
    prefetch = setup.prefetch if setup.prefetch is not None else cuda
    readers: list[LayerPrefetch] = []

    def built(model: torch.nn.Module) -> None:  # the first layer is read while the embeddings are looked up
        if prefetch:
            readers.append(LayerPrefetch(src, src.arch.decoder_layers(model), pin=cuda))
            readers[0].start(setup.start_layer)

    try:
        model, state = prepare(src, input_ids, setup, comm, built)
    except BaseException:
        for r in readers:
            r.close()
        raise
    arch = state.arch
    layers = arch.decoder_layers(model)
    default = recipe.linear_scheme()
    # where it runs, on the bar from the start (--device auto), and in what, unless plain fp32
    stage = f"calibrate ({state.device}" + ("" if state.compute == "fp32" else f", {state.compute}") + ")"
    if progress:
        progress(stage, setup.start_layer, len(layers))
    reader = readers[0] if readers else None
    # exact float transforms need fp32 weights; without them a layer is read straight into the passes' dtype
    # (the same values as through fp32: every stored float widens to fp32 exactly)
    load_dtype = torch.float32 if transforms is not None else state.dtype
    try:
        for i in range(setup.start_layer, len(layers)):
            layer, prefix = layers[i], arch.layer_prefix(i)
            arch.check_layer(layer, i)
            if reader is not None:
                reader.load(i, state.device, load_dtype)  # read in line when not prefetched
                reader.start(i + 1)  # read while this layer calibrates
            else:
                materialize(layer, prefix, src, load_dtype, state.device)
            src.close()  # drop mmaps: file pages touched would otherwise stay in RSS, growing with depth
            result = LayerResult(index=i, prefix=prefix)
            if transforms is not None:
                transforms(layer, i, state, result)  # exact float transforms: in fp32 whatever the passes use
            if state.dtype != torch.float32:
                layer.to(state.dtype)  # --compute-dtype bf16: transformed weights and the layer's buffers
            plan = plan_layer(layer, prefix, recipe.scheme.targets, recipe.scheme.ignore, arch)
            result.report["skipped"] = {prefix + n: why for n, why in plan.skipped}
            schemes = layer_schemes(i, plan) if layer_schemes else {g: default for g in plan.groups}
            cal = LayerCalibrator(layer, i, plan, recipe=recipe, schemes=schemes, state=state, result=result)
            try:
                cal.run(cal.stage_order())
            finally:
                cal.close()
            on_layer(result, state)
            release(layer)
            result = cal = None  # a finished layer's fp32 results must not outlive it into the next load
            if progress:
                progress(stage, i + 1, len(layers))
    finally:
        if reader is not None:
            reader.close()
        state.close()
