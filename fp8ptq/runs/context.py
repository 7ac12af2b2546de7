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
from typing import TYPE_CHECKING

import torch

import fp8ptq
from fp8ptq import gates as gates_mod
from fp8ptq.calibrate.state import Progress
from fp8ptq.dist import LocalComm, TorchComm, init_from_env
from fp8ptq.draft.auto import KINDS as DRAFT_BUNDLE_KINDS
from fp8ptq.errors import Fp8ptqError, RecipeError, check_option
from fp8ptq.export.rundir import RunDir
from fp8ptq.export.writer import CheckpointWriter
from fp8ptq.io import check_output
from fp8ptq.models.loader import ModelSource
from fp8ptq.ops.precision import COMPUTE_DTYPES
from fp8ptq.quantization.schemes import handler
from fp8ptq.recipe import Recipe, load_recipe
from fp8ptq.runs.config import QuantizeConfig
from fp8ptq.runs.overrides import recipe_overrides

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fp8ptq.calibrate.images import ImageRows


@dataclass
class RunContext:
    """Everything the steps of one quantize run share (built by `prepare_run`, completed by `open_run`)."""

    cfg: QuantizeConfig
    recipe: Recipe
    device: str
    gates: list[gates_mod.Gate]
    gates_skipped: list[str]
    comm: LocalComm | TorchComm
    progress: Progress | None = None
    src: ModelSource | None = None
    tokenizer: PreTrainedTokenizerBase | None = None
    ids: torch.Tensor | None = None  # calibration samples; None: data-free
    images: ImageRows | None = None  # the image+text samples among ids (--images)
    run: RunDir | None = None  # rank 0 only
    path: Path | None = None  # the hidden run directory (every rank)
    state: dict = field(default_factory=dict)  # the run directory's state.json (resume)
    resumed: bool = False
    # the first layer this run calibrates: the state's checkpoint when the run opened (the state's own
    # value moves on as this run checkpoints; the manifest's resumed_from_layer reported the final one)
    start_layer: int = 0
    writer: CheckpointWriter | None = None  # rank 0 only
    timings: dict[str, float] = field(default_factory=dict)
    compute_dtype: str = "fp32"  # the layer passes' arithmetic, resolved (resolve_compute_dtype)

    @property
    def chunk_samples(self) -> int:
        return chunk_samples(self.cfg.chunk_tokens, self.ids)

    def fingerprint(self) -> dict:
        """What a resumed run must share with the interrupted one for the result to be the same."""
        ids = self.ids
        return {
            "model": self.src.label,
            "model_bytes": self.src.size_bytes(),
            "model_content": self.src.content_hash(),
            "fp8ptq": fp8ptq.__version__,
            "recipe": self.recipe.model_dump(mode="json"),
            "calibration_data": None if ids is None else hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
            "chunk_tokens": self.cfg.chunk_tokens,
            "world_size": self.comm.world,
            "compute_dtype": self.compute_dtype,
        } | ({} if self.images is None else {"calibration_images": self.images.digest()})


def run_inputs(cfg: QuantizeConfig) -> tuple:
    """The paths a quantize run reads: its output may be none of them, nor hold nor sit inside one."""
    return (cfg.model, cfg.data) + (() if cfg.images is None else (cfg.images,))


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


def resolve_compute_dtype(requested: str, device: str) -> str:
    """--compute-dtype: auto -> tf32 on CUDA (KL within noise of fp32 on the GPU benchmark, BENCHMARKS.md),
    fp32 on a CPU (TF32 is a CUDA matmul mode; a CPU's bf16 passes change the result for no gain here)."""
    if requested == "auto":
        return "tf32" if device.startswith("cuda") else "fp32"
    if requested not in COMPUTE_DTYPES:
        raise Fp8ptqError(f"unknown --compute-dtype '{requested}'", fix="use auto, " + ", ".join(COMPUTE_DTYPES))
    if requested == "tf32" and not device.startswith("cuda"):
        raise Fp8ptqError(
            f"--compute-dtype tf32 on --device {device}: TF32 is a CUDA matmul mode",
            fix="use --compute-dtype fp32 or bf16 on a CPU, or --device cuda",
        )
    return requested


def describe_device(requested: str) -> str:
    """The one line a command prints about where it runs: `--device auto` must say what it picked."""
    device = resolve_device(requested)
    if device.startswith("cuda"):
        where = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    else:
        where = "cpu" + ("" if torch.cuda.is_available() else ", no CUDA device")
    return f"device: {where}" + (" (--device auto)" if requested == "auto" else "")


def prepare_run(cfg: QuantizeConfig, progress: Progress | None = None) -> RunContext:
    """Validate the command (recipe + overrides, gates, output, device) before any model is read, then
    join the process group (torchrun) or run alone."""
    recipe = load_recipe(cfg.recipe)
    _check_options(cfg, recipe)
    check_output(cfg.output, cfg.overwrite, run_inputs(cfg))
    device = resolve_device(cfg.device)
    recipe = recipe_overrides(cfg, recipe)
    if cfg.images is not None:
        if not recipe.needs_data:
            raise RecipeError(
                f"--images with recipe '{recipe.name}': it is data-free (no calibration to show images to)",
                fix="use a calibrated recipe (fp8-kv8, w8a8-int8, w4a16, ...) or leave out --images",
            )
        from fp8ptq.calibrate.images import read_rows

        read_rows(cfg.images)  # its rows and their form, before the model is read
    gates, skipped = _gates(cfg, recipe)
    return RunContext(
        cfg=cfg,
        recipe=recipe,
        device=device,
        gates=gates,
        gates_skipped=skipped,
        comm=init_from_env(device),
        progress=progress,
        compute_dtype=resolve_compute_dtype(cfg.compute_dtype, device),
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
    gs = recipe.scheme.weights.group_size if recipe.scheme.weights.strategy == "group" else None
    check_option(
        "--group-size",
        cfg.group_size,
        minimum=8,
        maximum=1024,
        example=64,
        note=f"{uses} {gs}" if gs else f"recipe '{recipe.name}' has no group weights",
    )
    b = recipe.scheme.weights.block_structure
    check_option(
        "--block-size",
        cfg.block_size,
        minimum=8,
        maximum=1024,
        example=128,
        note=f"{uses} {b[0]}" if b else f"recipe '{recipe.name}' has no block weights",
    )
    if cfg.draft is not None:
        d = cfg.draft
        if d.kind not in DRAFT_BUNDLE_KINDS:
            raise RecipeError(f"unknown draft kind '{d.kind}'", fix=f"use one of {', '.join(DRAFT_BUNDLE_KINDS)}")
        check_option("--draft-trim", d.trim_keep, minimum=1, example=8192)
        check_option("--draft-steps", d.max_steps, minimum=1, example=400)
        check_option("--draft-time-budget", d.time_budget_s, minimum=1e-3, example=900)


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
        run = RunDir(
            ctx.cfg.output,
            overwrite=ctx.cfg.overwrite,
            resume=ctx.cfg.resume,
            fingerprint=ctx.fingerprint(),
            inputs=run_inputs(ctx.cfg),
        )
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
    ctx.start_layer = ctx.state.get("checkpoint", 0)
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


def check_model(src, recipe: Recipe):
    """Before any work: the weights are the model their config describes (models.skeleton.check_agrees)
    and the recipe's groups and blocks fit them. Returns the source's tokenizer (loaded once, for the run:
    a rotated copy of the model carries the same tokenizer files)."""
    from fp8ptq.eval.quality import read_quantization_config
    from fp8ptq.models.skeleton import check_agrees

    tokenizer = src.tokenizer()
    check_agrees(src, tokenizer)
    raw = getattr(src.config, "quantization_config", None)
    if raw is not None:  # a quantized source is read through its scheme: it must parse (a ModelError if not)
        read_quantization_config(src, raw)
    check_group_sizes(src, recipe)
    return tokenizer


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
    from fp8ptq.quantization.plan import plan_layer
    from fp8ptq.quantization.weights import check_block_size, valid_block_sizes

    schemes = [recipe.scheme] + ([recipe.mixed] if recipe.mixed else [])
    args = [a for s in schemes for a in (s.weights, s.input_activations) if a is not None]  # input groups too
    sizes = {a.group_size for a in args if a.group_size}
    blocks = {tuple(a.block_structure) for a in args if a.block_structure}
    arch = src.arch
    widths, outs, first = {}, {}, {}  # every kind of layer (DeepSeek: dense first layers, MoE after)
    for i, layer in enumerate(arch.decoder_layers(build_skeleton(src.config))):
        plan = plan_layer(layer, arch.layer_prefix(i), recipe.scheme.targets, recipe.scheme.ignore, arch)
        modules = dict(layer.named_modules())
        widths.update({n: modules[n].in_features for n in plan.modules})
        outs.update({n: modules[n].out_features for n in plan.modules})
        first.update({n: arch.layer_prefix(i) for n in plan.modules if n not in first})
    if not widths:  # the export would declare a quantized format over nothing
        raise RecipeError(
            f"recipe '{recipe.name}': its targets {list(recipe.scheme.targets)} (less its ignore) match no Linear "
            f"of the model's decoder layers",
            fix="check the target names (`fp8ptq inspect` lists the model's Linears), e.g. targets: [Linear]",
        )
    check_packed_zero_points(recipe, [s.weights for s in schemes if s.weights is not None], outs, widths)
    if not sizes and not blocks:
        return
    for b in blocks:  # named by the first layer that has the Linear, every expert once
        shapes = {first[n] + _EXPERT_INDEX.sub(".N.", n): (outs[n], w) for n, w in widths.items()}
        try:
            check_block_size(shapes, b)
        except ValueError as err:
            common = valid_block_sizes([x for shape in shapes.values() for x in shape])
            raise RecipeError(
                f"recipe '{recipe.name}': {err}",
                fix=f"pass --block-size with a size dividing every quantized Linear: {', '.join(map(str, common))}",
            ) from None
    if recipe.flatten is not None and arch.flatten is not None and arch.flatten.down in widths:
        f = recipe.flatten
        widths[arch.flatten.down] = flattened_width(widths[arch.flatten.down], f.extra_channels, f.multiple, f.tp)
    common = sorted(set.intersection(*(set(valid_group_sizes(w)) for w in widths.values())))
    fixed = {handler(a).fixed_group_size(a) for a in args}  # NVFP4 16, MXFP4 / MXFP8 32, or None
    for size in sizes:
        bad = sorted({f"{_EXPERT_INDEX.sub('.N.', n)} ({w})" for n, w in widths.items() if w % size})
        if bad:
            fix = f"use a group size that divides every quantized layer: {', '.join(map(str, common))}"
            if size in fixed:
                fix = f"the format fixes groups of {size}: add those Linears to the recipe's scheme.ignore"
            raise RecipeError(f"group_size {size} does not divide the input width of {', '.join(bad)}", fix=fix)


def check_packed_zero_points(recipe: Recipe, weights: list, outs: dict[str, int], widths: dict[str, int]) -> None:
    """Asymmetric grouped INT weights store their zero points packed along the output rows, 32 / num_bits
    rows per int32; compressed-tensors 0.17 cannot unpack one packed row of several groups (transposed,
    it is not viewable as bytes), so neither transformers nor its decompressor could read the export of
    a Linear with that few rows: refused before any work, naming the Linears."""
    for w in weights:
        grouped = str(getattr(w.strategy, "value", w.strategy)) == "group" and w.group_size
        if w.type != "int" or w.symmetric or not grouped or w.num_bits >= 32:
            continue
        rows = 32 // w.num_bits
        few = {n: o for n, o in outs.items() if o <= rows and widths[n] > w.group_size}
        bad = sorted({f"{_EXPERT_INDEX.sub('.N.', n)} ({o})" for n, o in few.items()})
        if bad:
            raise RecipeError(
                f"recipe '{recipe.name}': the packed zero points of a Linear with at most {rows} output rows "
                f"cannot be unpacked by compressed-tensors: {', '.join(bad)}",
                fix="add those Linears to the recipe's scheme.ignore, or use symmetric weights",
            )
