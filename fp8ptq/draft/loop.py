"""The one training loop of both trainers (the draft model's distillation, `train.py`, and the EAGLE-3
head's, `eagle3_train.py`): AdamW steps with the learning-rate schedule, gradient clipping, a time
budget, resumable checkpoints (trainable weights + AdamW moments + step, safetensors, written
atomically) and the summary both report. What differs, the loss of a step and its data, is the
caller's `loss_at(step)`, a pure function of the step so a resumed run equals an uninterrupted one."""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch
from safetensors.torch import load_file, save_file

from fp8ptq.export.rundir import output_lock
from fp8ptq.io import write_atomic, write_json_atomic
from fp8ptq.results import read_json, to_json


@dataclass(frozen=True)
class TrainRun:
    """What a training run reports: steps, stop reason, the loss at the start and over the last 20 steps
    (both trainers' summaries carry these fields), its seconds and every step's loss."""

    steps: int
    resumed_from: int
    stopped_by: str  # max_steps | time_budget
    loss_first: float | None
    loss_last: float | None
    train_s: float
    losses: tuple[float, ...]

    def fields(self) -> dict:
        """The fields a trainer's summary repeats (its file leaves out the seconds and the loss curve)."""
        keys = ("steps", "resumed_from", "stopped_by", "loss_first", "loss_last")
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True, kw_only=True)
class TrainSummary:
    """What both trainers return and write beside their output (DraftSummary, Eagle3Summary extend it)."""

    SCHEMA: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int] = 1
    target: str
    target_path: str
    config: dict[str, str]  # the trainer's config as run, values as text
    loss: str  # what was minimised
    steps: int
    resumed_from: int
    stopped_by: str
    loss_first: float | None
    loss_last: float | None
    timings: dict[str, float]
    losses: tuple[float, ...] = ()  # every step's loss: in memory only, never in the file or --json

    def file_json(self) -> dict:
        return {k: v for k, v in to_json(self).items() if k != "losses"}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.file_json(), indent=2) + "\n")


@dataclass(frozen=True)
class Checkpoint:
    """checkpoint.json beside a trainer's checkpoint.safetensors: where a resumed run starts."""

    SCHEMA: ClassVar[str] = "train-checkpoint"
    SCHEMA_VERSION: ClassVar[int] = 1
    step: int
    losses: list[float]
    elapsed_s: float


def trainable(module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


def lr_at(step: int, cfg, elapsed_s: float = 0.0, warm_s: float = 0.0) -> float:
    """Linear warm-up, then a cosine from lr down to 0.1·lr over the run's progress after warm-up: the
    larger of the step fraction and, with a time budget, the fraction of the budget left after warm-up
    (`warm_s`: the seconds warm-up took) that is spent — so the rate decays by whichever bound ends the
    run, and a slow warm-up does not eat the cosine."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    if cfg.time_budget_s:
        t = max(t, (elapsed_s - warm_s) / max(cfg.time_budget_s - warm_s, 1e-9))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def save_checkpoint(path: Path, module, opt, step: int, losses: list[float], elapsed: float) -> None:
    params = trainable(module)
    tensors = {f"model.{n}": p.detach().cpu().contiguous() for n, p in params}
    for n, p in params:
        st = opt.state.get(p)
        if st:
            tensors[f"opt.{n}.exp_avg"] = st["exp_avg"].cpu().contiguous()
            tensors[f"opt.{n}.exp_avg_sq"] = st["exp_avg_sq"].cpu().contiguous()
            tensors[f"opt.{n}.step"] = torch.as_tensor(st["step"], dtype=torch.float64).reshape(1).cpu()
    write_atomic(path, lambda tmp: save_file(tensors, str(tmp)))
    write_json_atomic(path.with_suffix(".json"), to_json(Checkpoint(step, losses, elapsed)))


def load_checkpoint(path: Path, module, opt, device: str) -> tuple[int, list[float], float]:
    """Weights and AdamW moments back from a checkpoint; returns (step, losses, elapsed seconds)."""
    t = load_file(str(path))
    params = dict(trainable(module))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(t[f"model.{n}"])
    for n, p in params.items():
        if f"opt.{n}.exp_avg" in t:
            opt.state[p] = {
                "step": t[f"opt.{n}.step"].reshape(()).to(torch.float32),
                "exp_avg": t[f"opt.{n}.exp_avg"].to(device),
                "exp_avg_sq": t[f"opt.{n}.exp_avg_sq"].to(device),
            }
    saved = read_json(path.with_suffix(".json"), Checkpoint, fix="delete the work directory to train afresh")
    return saved.step, list(saved.losses), saved.elapsed_s


def train_summary(step: int, start: int, stopped: str, t0: float, losses: list[float]) -> TrainRun:
    k = max(1, min(20, len(losses)))
    return TrainRun(
        steps=step,
        resumed_from=start,
        stopped_by=stopped,
        loss_first=losses[0] if losses else None,
        loss_last=sum(losses[-k:]) / k if losses else None,
        train_s=time.perf_counter() - t0,
        losses=tuple(losses),
    )


def fit(
    module,
    opt,
    cfg,
    loss_at: Callable[[int], torch.Tensor],
    *,
    ckpt: Path | None,
    resumed: tuple[int, list[float], float] = (0, [], 0.0),
    progress=None,
) -> TrainRun:
    """Train `module` until cfg.max_steps or cfg.time_budget_s (at least one step after a resume), from
    `resumed` (step, losses, elapsed); checkpoints every cfg.checkpoint_every steps and at the end when
    `ckpt` is given."""
    params = [p for _, p in trainable(module)]
    step, losses, elapsed = resumed
    start, t0, stopped = step, time.perf_counter() - elapsed, "max_steps"
    warm_s = 0.0  # a run resumed after warm-up counts the budget from its start
    module.train()
    while step < cfg.max_steps:
        if cfg.time_budget_s is not None and time.perf_counter() - t0 >= cfg.time_budget_s and step > start:
            stopped = "time_budget"
            break
        if step == cfg.warmup_steps and step > start:
            warm_s = time.perf_counter() - t0
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, time.perf_counter() - t0, warm_s)
        loss = loss_at(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        step += 1
        if progress:
            progress("train", step, cfg.max_steps)
        if ckpt is not None and step % cfg.checkpoint_every == 0:
            save_checkpoint(ckpt, module, opt, step, losses, time.perf_counter() - t0)
    if ckpt is not None:
        save_checkpoint(ckpt, module, opt, step, losses, time.perf_counter() - t0)
    module.eval()
    return train_summary(step, start, stopped, t0, losses)


def locked_output(train):
    """A trainer `train(cfg, progress=None)` run under the lock on writing cfg.output (export/rundir.py):
    its work directory beside the output is this run's alone, and a second run for the same output fails
    at once, before loading anything."""

    @functools.wraps(train)
    def run(cfg, progress=None):
        with output_lock(Path(cfg.output)):
            return train(cfg, progress)

    return run
