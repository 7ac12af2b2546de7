"""One quantize run's typed context: the validated command (recipe with overrides, gates, device), the
model and data, the process group, and the (possibly resumed) run directory. Every check that needs
no model weights happens in `prepare_run`, before the model is read."""

from __future__ import annotations

import hashlib
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

import fp8ptq
from fp8ptq import data as data_mod
from fp8ptq import gates as gates_mod
from fp8ptq.calibrate.state import Progress
from fp8ptq.dist import init_from_env
from fp8ptq.errors import Fp8ptqError, RecipeError, check_option
from fp8ptq.export.rundir import RunDir
from fp8ptq.export.writer import CheckpointWriter
from fp8ptq.io import check_output
from fp8ptq.models.loader import ModelSource
from fp8ptq.recipe import Recipe, load_recipe, parse_recipe


@dataclass(frozen=True)
class QuantizeConfig:
    model: str
    recipe: str
    output: Path
    data: str = data_mod.BUILTIN
    text_field: str = "text"
    revision: str | None = None  # hub ids: branch, tag or commit
    num_samples: int | None = None  # None: the recipe's
    seq_len: int | None = None
    seed: int | None = None
    chat_template: bool = False
    overwrite: bool = False
    eval_samples: int = 8  # held-out samples for the quality check written into the manifest; 0 = skip
    eval_seq_len: int = 512
    gates: tuple[str, ...] = ()  # added to the recipe's own gates
    recipe_gates: bool = True  # False: ignore the recipe's gates
    device: str = "cpu"  # cpu | cuda | cuda:N | auto
    chunk_tokens: int = 8192  # calibration tokens per chunk (memory per step; results do not depend on it)
    offload_activations: bool = False  # keep calibration activations on disk instead of RAM
    resume: bool = False  # continue an interrupted run of the same command
    checkpoint_every_s: float = 300.0  # activation checkpoints at least this often (every layer when small)
    int4_fraction: float | None = None  # mixed recipes: override the recipe's 4-bit FLOP share
    draft: str = "none"  # "auto": also train a draft, measure and write the speculative config (spec/auto.py)
    draft_trim: int | None = None  # with draft=auto: also a VocabTrim draft keeping this many tokens
    draft_steps: int = 400
    draft_time_budget_s: float | None = 900.0
    tp: int | None = None  # flatten recipes: override the tensor-parallel size


@dataclass
class RunContext:
    """Everything the steps of one quantize run share (built by `prepare_run`, completed by `open_run`)."""

    cfg: QuantizeConfig
    recipe: Recipe
    device: str
    gates: list[gates_mod.Gate]
    gates_skipped: list[str]
    comm: object
    progress: Progress | None = None
    src: ModelSource | None = None
    tokenizer: object = None
    ids: torch.Tensor | None = None  # calibration samples; None: data-free
    run: RunDir | None = None  # rank 0 only
    path: Path | None = None  # the hidden run directory (every rank)
    state: dict = field(default_factory=dict)  # the run directory's state.json (resume)
    resumed: bool = False
    writer: CheckpointWriter | None = None  # rank 0 only
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def start_layer(self) -> int:
        return self.state.get("checkpoint", 0)

    @property
    def chunk_samples(self) -> int:
        return chunk_samples(self.cfg.chunk_tokens, self.ids)

    def fingerprint(self) -> dict:
        """What a resumed run must share with the interrupted one for the result to be the same."""
        ids = self.ids
        return {
            "model": self.src.label,
            "model_bytes": self.src.size_bytes(),
            "fp8ptq": fp8ptq.__version__,
            "recipe": self.recipe.model_dump(mode="json"),
            "calibration_data": None if ids is None else hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
            "chunk_tokens": self.cfg.chunk_tokens,
            "world_size": self.comm.world,
        }


def chunk_samples(chunk_tokens: int, ids: torch.Tensor) -> int:
    return max(1, chunk_tokens // ids.shape[1])


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Fp8ptqError(f"--device {device}: this torch has no CUDA device", fix="use --device cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        raise Fp8ptqError(f"unknown --device '{device}'", fix="use auto, cpu, cuda or cuda:N")
    return device


def prepare_run(cfg: QuantizeConfig, progress: Progress | None = None) -> RunContext:
    """Validate the command (recipe + overrides, gates, output, device) before any model is read, then
    join the process group (torchrun) or run alone."""
    recipe = load_recipe(cfg.recipe)
    _check_options(cfg, recipe)
    check_output(cfg.output, cfg.overwrite)
    device = resolve_device(cfg.device)
    overrides = {
        k: v
        for k, v in (("num_samples", cfg.num_samples), ("seq_len", cfg.seq_len), ("seed", cfg.seed))
        if v is not None
    }
    if overrides:
        recipe = recipe.model_copy(update={"calibration": recipe.calibration.model_copy(update=overrides)})
    recipe = _recipe_overrides(cfg, recipe)
    if cfg.draft not in ("none", "auto"):
        raise RecipeError(f"unknown --draft '{cfg.draft}'", fix="use --draft auto (train a draft) or none")
    gates, skipped = _gates(cfg, recipe)
    return RunContext(
        cfg=cfg,
        recipe=recipe,
        device=device,
        gates=gates,
        gates_skipped=skipped,
        comm=init_from_env(device),
        progress=progress,
    )


def _check_options(cfg: QuantizeConfig, recipe: Recipe) -> None:
    """Every numeric option in range, naming the flag, the value, the range and the recipe in use."""
    cal = recipe.calibration
    uses = f"recipe '{recipe.name}' uses"
    check_option("--num-samples", cfg.num_samples, minimum=1, note=f"{uses} {cal.num_samples}")
    check_option("--seq-len", cfg.seq_len, minimum=8, maximum=1 << 20, note=f"{uses} {cal.seq_len}", example=512)
    check_option("--seed", cfg.seed, minimum=0, note=f"{uses} {cal.seed}")
    check_option("--eval-samples", cfg.eval_samples, minimum=0, note="0 skips the quality check", example=8)
    check_option("--chunk-tokens", cfg.chunk_tokens, minimum=1, example=8192)
    check_option(
        "--int4-fraction",
        cfg.int4_fraction,
        minimum=0.0,
        maximum=1.0,
        example=0.5,
        note=f"{uses} {recipe.mixed.int4_fraction}" if recipe.mixed else f"recipe '{recipe.name}' is not mixed",
    )
    check_option("--tp", cfg.tp, minimum=1, note=f"{uses} {recipe.flatten.tp}" if recipe.flatten else "")
    check_option("--draft-trim", cfg.draft_trim, minimum=1, example=8192)
    check_option("--draft-steps", cfg.draft_steps, minimum=1, example=400)
    check_option("--draft-time-budget", cfg.draft_time_budget_s, minimum=1e-3, example=900)


def _recipe_overrides(cfg: QuantizeConfig, recipe: Recipe) -> Recipe:
    """--int4-fraction / --tp change the recipe's mixed / flatten sections (validated like the YAML)."""
    data = recipe.model_dump(mode="json")
    for value, section, key, flag in (
        (cfg.int4_fraction, "mixed", "int4_fraction", "--int4-fraction"),
        (cfg.tp, "flatten", "tp", "--tp"),
    ):
        if value is None:
            continue
        if data.get(section) is None:
            raise RecipeError(
                f"{flag} needs a recipe with a '{section}' section; '{recipe.name}' has none",
                fix=f"drop {flag} or use a recipe such as {'mixed-w4-w8' if section == 'mixed' else 'flatten-w8a8'}",
            )
        data[section][key] = value
    return parse_recipe(data, f"{recipe.name} with command-line overrides")


def _gates(cfg: QuantizeConfig, recipe: Recipe) -> tuple[list[gates_mod.Gate], list[str]]:
    """(gates to check, recipe gates skipped), checked before any work. A gate on a quality metric needs the
    quality check: asked for with --gate it is an error without one; a recipe's own is skipped and reported."""
    known = gates_mod.QUANTIZE_METRICS
    gates, skipped = [], []
    for g, from_recipe in [(g, True) for g in (recipe.gates if cfg.recipe_gates else ())] + [
        (g, False) for g in cfg.gates
    ]:
        g = gates_mod.parse_gate(g)
        if g.metric not in known:
            raise RecipeError(
                f"gate '{g}': quantize has no metric '{g.metric}'",
                fix=f"quantize gates use {', '.join(sorted(known))}; task scores are gated by `fp8ptq eval`",
            )
        if g.metric in gates_mod.QUALITY_METRICS and cfg.eval_samples == 0:
            if from_recipe:
                skipped.append(str(g))
                continue
            raise RecipeError(
                f"gate '{g}' needs the quality check, but --eval-samples is 0",
                fix="keep --eval-samples > 0 (default 8)",
            )
        gates.append(g)
    return gates, skipped


@contextmanager
def open_run(ctx: RunContext):
    """Rank 0 opens (or resumes) the hidden run directory; every rank learns its state (or rank 0's error).
    On success the caller commits; on error the directory is kept only if it holds finished layers."""
    run, msg = None, None
    if ctx.comm.rank == 0:
        run = RunDir(ctx.cfg.output, overwrite=ctx.cfg.overwrite, resume=ctx.cfg.resume, fingerprint=ctx.fingerprint())
        try:
            run.__enter__()
            msg = {"ok": True, "state": run.state, "resumed": run.resumed, "path": str(run.path)}
        except Fp8ptqError as err:
            if ctx.comm.world == 1:
                raise
            msg = {"ok": False, "message": err.message, "fix": err.fix}
    msg = ctx.comm.broadcast_object(msg)
    if not msg["ok"]:
        raise Fp8ptqError(msg["message"], fix=msg["fix"])
    ctx.run, ctx.state, ctx.resumed, ctx.path = run, msg["state"], msg["resumed"], Path(msg["path"])
    ctx.writer = CheckpointWriter(ctx.src, ctx.path) if ctx.comm.rank == 0 else None
    try:
        yield ctx
    except BaseException:
        if run is not None:
            run.__exit__(*sys.exc_info())
        raise
    if run is not None:
        run.__exit__(None, None, None)


_EXPERT_INDEX = re.compile(r"[.][0-9]+[.]")  # experts.7.w2 -> experts.N.w2: each expert weight named once


def check_group_sizes(src: ModelSource, recipe: Recipe) -> None:
    """Before any work: the model's family takes the recipe, and a group size divides the input width of
    every Linear it will quantize (after flattening, for the MLP's down projection)."""
    why = src.arch.refuses(recipe)
    if why is not None:
        raise RecipeError(
            why, fix="use a recipe without that section (`fp8ptq recipes list`: e.g. fp8-dynamic or w4a16)"
        )
    from fp8ptq.models.skeleton import build_skeleton
    from fp8ptq.ops.intq import valid_group_sizes
    from fp8ptq.outliers.flatten import flattened_width
    from fp8ptq.quantize.plan import plan_layer

    args = [a for a in (recipe.scheme.weights, recipe.mixed.weights if recipe.mixed else None) if a is not None]
    sizes = {a.group_size for a in args if a.group_size}
    if not sizes:
        return
    arch = src.arch
    widths = {}  # every kind of layer (DeepSeek: dense first layers, MoE after)
    for i, layer in enumerate(arch.decoder_layers(build_skeleton(src.config))):
        plan = plan_layer(layer, arch.layer_prefix(i), recipe.scheme.targets, recipe.scheme.ignore, arch)
        modules = dict(layer.named_modules())
        widths.update({n: modules[n].in_features for n in plan.modules})
    if recipe.flatten is not None and arch.flatten is not None and arch.flatten.down in widths:
        f = recipe.flatten
        widths[arch.flatten.down] = flattened_width(widths[arch.flatten.down], f.extra_channels, f.multiple, f.tp)
    common = sorted(set.intersection(*(set(valid_group_sizes(w)) for w in widths.values())))
    for size in sizes:
        bad = sorted({f"{_EXPERT_INDEX.sub('.N.', n)} ({w})" for n, w in widths.items() if w % size})
        if bad:
            raise RecipeError(
                f"group_size {size} does not divide the input width of {', '.join(bad)}",
                fix=f"use a group size that divides every quantized layer: {', '.join(map(str, common))}",
            )
