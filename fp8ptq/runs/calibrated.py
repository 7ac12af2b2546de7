"""The calibrated path: the sequential pipeline over this rank's samples, with the recipe's transforms
and 4/8-bit plan, each finished layer written by rank 0, and activation checkpoints for --resume."""

from __future__ import annotations

import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from fp8ptq.calibrate.pipeline import LayerHooks, calibrate
from fp8ptq.calibrate.state import CalibrationSetup, RunState
from fp8ptq.calibrate.transforms import make_transforms
from fp8ptq.dist import ChunkPlan
from fp8ptq.errors import Fp8ptqError
from fp8ptq.export.writer import BackgroundWrites
from fp8ptq.quantization.results import LayerResult
from fp8ptq.runs.context import RunContext

RESUME_DIR = "resume"
# A checkpoint is written once the time since the last one is this many times what writing the last
# one took (at most ~2% of the run goes to checkpoints), and never more than checkpoint_every_s apart.
# Writing the store after every layer cost 6% of a SmolLM2 fp8-kv8 run (30 x 75 MB, fsynced).
CHECKPOINT_COST_RATIO = 50
# Before the first checkpoint its cost is estimated from the store's size at this write rate (a plain
# disk with fsync), so the first one is not due after layer 0 (an 8B-width store of 64 x 512 tokens is
# 512 MiB: ~0.5 s, first checkpoint after ~25 s of calibration).
CHECKPOINT_BYTES_PER_S = 1 << 30


def checkpoint_file(resume_dir: Path, rank: int, layer: int) -> Path:
    """The activations entering `layer`, saved by `rank`. Named by the layer: the state's `checkpoint` and
    its file change together only when the state is written, so a run killed after a new file was saved
    but before the state named it resumes from the file the state names (one name for every checkpoint
    let a kill there resume layer k's inputs from a later layer's activations: different bits)."""
    return resume_dir / f"hidden.rank{rank}.layer{layer}.bin"


def chunks_per_rank(ctx: RunContext, world: int) -> list[int]:
    plan = ChunkPlan(ctx.ids.shape[0], ctx.chunk_samples, 0, world, 0 if ctx.images is None else ctx.images.singles)
    return [len(plan.owned(r)) for r in range(world)]


def calibrate_into(ctx: RunContext) -> None:
    comm, src = ctx.comm, ctx.src
    idle = [r for r, n in enumerate(chunks_per_rank(ctx, comm.world)) if n == 0]
    if idle:
        raise Fp8ptqError(
            f"{ctx.ids.shape[0]} samples in chunks of {ctx.chunk_samples} leave ranks {idle} of "
            f"{comm.world} without work",
            fix="use fewer processes, more --num-samples, or a smaller --chunk-tokens",
        )
    resume_dir = ctx.path / RESUME_DIR
    start = ctx.start_layer
    setup = CalibrationSetup(
        ctx.recipe,
        chunk_samples=ctx.chunk_samples,
        device=ctx.device,
        compute_dtype=ctx.compute_dtype,
        images=ctx.images,
        offload_dir=resume_dir if ctx.cfg.offload_activations else None,
        start_layer=start,
        restore=checkpoint_file(resume_dir, comm.rank, start) if start > 0 else None,
    )
    last = {"t": time.monotonic(), "cost": None}
    # Layer i is compressed here, then serialised and fsynced by a writer thread while layer i+1 calibrates
    # (as on the data-free path); the run state records a layer as done only once it is on disk.

    def done(i: int) -> None:
        if ctx.run is not None:
            ctx.run.save_state(layers_done=i + 1)

    def on_layer(res: LayerResult, st: RunState) -> None:
        i = res.index
        writes.submit(res)
        if last["cost"] is None:
            last["cost"] = st.store.nbytes / CHECKPOINT_BYTES_PER_S
        since = time.monotonic() - last["t"]
        final = i + 1 == src.num_layers  # nothing left to resume: no activations to save
        due = not final and since >= min(ctx.cfg.checkpoint_every_s, CHECKPOINT_COST_RATIO * last["cost"])
        due = bool(comm.max_(torch.tensor([float(due)])))  # clocks differ: all ranks save, or none
        if due:  # every rank saves its own activations, then rank 0 records the checkpoint
            resume_dir.mkdir(exist_ok=True)
            t0 = time.monotonic()
            st.store.save(checkpoint_file(resume_dir, comm.rank, i + 1))
            last["t"], last["cost"] = time.monotonic(), time.monotonic() - t0
        comm.barrier()
        if due or final:  # a checkpoint names this layer as done: it must be on disk first
            writes.settle()
            if ctx.run is not None:
                ctx.run.save_state(checkpoint=i + 1)
        if due:  # the state names the new checkpoint on every rank's behalf: the older files can go
            comm.barrier()
            keep = checkpoint_file(resume_dir, comm.rank, i + 1)
            for old in resume_dir.glob(f"hidden.rank{comm.rank}.layer*.bin"):
                if old != keep:
                    old.unlink(missing_ok=True)

    with BackgroundWrites(ctx.writer, done) as writes:
        calibrate(
            src,
            ctx.recipe,
            ctx.ids,
            on_layer,
            progress=ctx.progress,
            setup=setup,
            comm=comm,
            hooks=LayerHooks(transforms=make_transforms(ctx.recipe, src), schemes=_mixed_schemes(ctx, setup)),
        )
    comm.barrier()
    if ctx.run is not None:
        shutil.rmtree(resume_dir, ignore_errors=True)


def _mixed_schemes(ctx: RunContext, setup: CalibrationSetup):
    """Mixed recipes: per group, the low-bit scheme for the modules the 4/8-bit plan chose, else the main one."""
    recipe = ctx.recipe
    if recipe.mixed is None:
        return None
    low = _mixed_low(ctx, setup)
    high, low_scheme = recipe.linear_scheme(), recipe.low_scheme()
    return lambda i, plan: {g: low_scheme if plan.prefix + g[0] in low else high for g in plan.groups}


def _mixed_low(ctx: RunContext, setup: CalibrationSetup) -> set[str]:
    """The modules at the low-bit scheme: planned once, kept in the run state so a resumed run reuses it."""
    from fp8ptq.calibrate.mixed import plan_mixed

    known = ctx.comm.broadcast_object(None if ctx.run is None else ctx.run.state.get("mixed"))
    if known is not None:
        return set(known["low"])
    plan = plan_mixed(ctx.src, ctx.recipe, ctx.ids, replace(setup, start_layer=0, restore=None), ctx.comm, ctx.progress)
    if ctx.run is not None:
        ctx.run.save_state(mixed={"low": sorted(plan.low), "report": plan.report})
    return set(plan.low)
