"""After the layers: assemble the shards, write config/tokenizer/recipe, and build the manifest (with
the optional draft bundle and quality check) on rank 0."""

from __future__ import annotations

import json
import platform
import re
import shutil
import time

import torch

import fp8ptq
from fp8ptq import data as data_mod
from fp8ptq.eval.bits import weight_bits
from fp8ptq.eval.stream import compare_streaming
from fp8ptq.export.compressed_tensors import quantization_config
from fp8ptq.io import write_bytes_atomic
from fp8ptq.manifest import CalibrationData, CalibrationImages, Manifest, Quality, RunInfo, Sizes, Speculative, Summary
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.models.tensors import mtp_prefixes
from fp8ptq.quantization.plan import UNCALLED
from fp8ptq.quantization.schemes import LinearScheme
from fp8ptq.recipe_files import recipe_record, recipe_yaml
from fp8ptq.runs.calibrated import chunks_per_rank
from fp8ptq.runs.context import RunContext


def versions() -> dict:
    import compressed_tensors
    import transformers

    return {
        "fp8ptq": fp8ptq.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "compressed-tensors": compressed_tensors.__version__,
        "python": platform.python_version(),
    }


def finish(ctx: RunContext) -> Manifest:
    """Shards, metadata and the manifest of a run whose layers are all written (rank 0)."""
    src, recipe, writer, run = ctx.src, ctx.recipe, ctx.writer, ctx.run
    layers = writer.reports()
    shards = ctx.state.get("shards")  # a resumed run that had already assembled its shards
    if not shards:
        t = time.perf_counter()
        shards = writer.finish(src.num_layers, _head(recipe), recipe.calibration)
        run.save_state(shards=shards, lm_head=writer.head_report)
        ctx.timings["assemble_s"] = time.perf_counter() - t  # non-layer tensors, shard names, index
    updates = _config_updates(layers) | _untie(run.state.get("lm_head"))
    write_metadata(ctx, updates, _export_groups(recipe, layers, run.state), _kept_float(ctx, layers))
    ids = ctx.ids
    manifest = Manifest(
        model=src.label,
        recipe=recipe_record(recipe),
        versions=versions(),
        calibration=None
        if ids is None
        else CalibrationData(
            source=ctx.cfg.data,
            samples=ids.shape[0],
            seq_len=ids.shape[1],
            tokens=ids.numel(),
            seed=recipe.calibration.seed,
            images=None
            if ctx.images is None
            else CalibrationImages(
                source=ctx.cfg.images, samples=len(ctx.images), own_arguments=ctx.images.own_arguments
            ),
        ),
        run=RunInfo(
            device=ctx.device,
            world_size=ctx.comm.world,
            resumed_from_layer=ctx.start_layer if ctx.resumed else None,
            offload_activations=ctx.cfg.offload_activations,
            chunk_tokens=ctx.cfg.chunk_tokens,
            chunks_per_rank=None if ids is None else chunks_per_rank(ctx, ctx.comm.world),
            compute_dtype=None if ids is None else ctx.compute_dtype,
        ),
        shards=shards,
        size_bytes=Sizes(
            source=src.size_bytes(),
            output=sum((ctx.path / s).stat().st_size for s in shards),
            weight_bits=weight_bits(open_hf_dir(ctx.path, label=str(ctx.cfg.output))),
        ),
        layers=layers,
        summary=summary(layers),
        mixed=run.state["mixed"]["report"] if recipe.mixed is not None else None,
        lm_head=run.state.get("lm_head"),
    )
    if ctx.cfg.draft is not None:  # the finished target is in place: distil, measure, recommend beside it
        manifest.speculative = _draft(ctx)
    if ctx.cfg.eval_samples > 0:
        manifest.quality = _quality(ctx)
    manifest.timings = ctx.timings
    return manifest


PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def write_metadata(ctx: RunContext, config_updates: dict, groups, kept: tuple[str, ...] = ()) -> None:
    src, out = ctx.src, ctx.path
    config = json.loads((src.path / "config.json").read_text())
    config.update(config_updates)
    config["quantization_config"] = quantization_config(ctx.recipe, groups, ctx.src.arch.keep_float + kept)
    write_bytes_atomic(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    # the checkpoint's own generation and processor files: a multimodal export serves as the same model
    for extra in ("generation_config.json", *PROCESSOR_FILES):
        if (src.path / extra).is_file():
            shutil.copy2(src.path / extra, out / extra)
    ctx.tokenizer.save_pretrained(str(out))
    write_bytes_atomic(out / "recipe.yaml", recipe_yaml(ctx.recipe).encode())


def _draft(ctx: RunContext) -> Speculative:
    from fp8ptq.draft.auto import build_draft_bundle

    t = time.perf_counter()
    bundle = build_draft_bundle(ctx.path, ctx.path, ctx.cfg.draft, device=ctx.device, progress=ctx.progress)
    ctx.timings["draft_s"] = time.perf_counter() - t
    return bundle


def _quality(ctx: RunContext) -> Quality:
    t = time.perf_counter()
    cfg = ctx.cfg
    eval_ids = data_mod.load_samples(
        data_mod.BUILTIN, ctx.tokenizer, cfg.eval_samples, cfg.eval_seq_len, "evaluation", 0
    )
    quant = open_hf_dir(ctx.path, label=str(cfg.output))
    result, numerics = compare_streaming(
        ctx.src, quant, eval_ids, device=ctx.device, simulate_reference=True, progress=ctx.progress
    )
    quality = Quality(**result, data="built-in evaluation split", numerics=numerics)
    ctx.timings["eval_s"] = time.perf_counter() - t
    return quality


def _kept_float(ctx: RunContext, layers: list[dict]) -> tuple[str, ...]:
    """`ignore` entries for what the export keeps float beyond the recipe's and the family's: Linears the
    generic path kept because the layer never calls them (quantization/plan.UNCALLED), by module and stored
    name, and the MTP modules carried as stored: neither the engine nor fp8ptq's reader may expect
    quantized tensors there."""
    names = {n for layer in layers for n, why in layer.get("skipped", {}).items() if why == UNCALLED}
    stored = {ctx.src.stored_name(f"{n}.weight").removesuffix(".weight") for n in names}
    # MTP modules, carried float (writer._rest_files): every module under them
    mtp = mtp_prefixes(ctx.src.weight_map, ctx.src.arch.layers, ctx.src.text_config)
    mtp = {"re:" + re.escape(ctx.src.stored_name(f"{p}.weight").removesuffix(".weight")) + r"\..*" for p in mtp}
    return tuple(sorted(names | stored | mtp))


def _head(recipe) -> LinearScheme | None:
    h = recipe.scheme.lm_head
    return None if h is None else LinearScheme(h.weights, h.input_activations)


def _untie(head: dict | None) -> dict:
    """A quantized tied head is written as its own tensor: the config must say so, or an engine would tie
    the head to the (float) embedding again and never read it."""
    return {"tie_word_embeddings": False} if head and head["tied"] else {}


def _export_groups(recipe, layers: list[dict], state: dict):
    """(scheme, module names) per compressed-tensors config group; None: the recipe's single group. A
    quantized LM head is a group of its own, targeted by name (an exact name wins over the class target
    `Linear` in compressed-tensors and vLLM)."""
    head = _head(recipe)
    if recipe.mixed is None:
        if head is None:
            return None
        return [(recipe.linear_scheme(), list(recipe.scheme.targets)), (head, ["lm_head"])]
    low = set(state["mixed"]["low"])
    names = sorted(n for layer in layers for n in layer["quantized"])
    groups = [(recipe.linear_scheme(), [n for n in names if n not in low])]
    if low:
        groups.append((recipe.low_scheme(), sorted(low)))
    return [g for g in groups if g[1]] + ([(head, ["lm_head"])] if head is not None else [])


def _config_updates(layers: list[dict]) -> dict:
    """config.json changes made by transforms: FlattenQuant widens every layer's MLP the same way."""
    widths = {layer["transforms"]["flatten"]["width"] for layer in layers if layer.get("transforms", {}).get("flatten")}
    assert len(widths) <= 1, f"layers flattened to different widths: {widths}"
    return {"intermediate_size": widths.pop()} if widths else {}


def summary(layers: list[dict]) -> Summary:
    skipped = {}
    for layer in layers:
        skipped.update(layer.get("skipped", {}))
    errs = [r.get("output_rel_err", r["weight_rel_err"]) for layer in layers for r in layer["quantized"].values()]
    return Summary(
        layers=len(layers),
        linears_quantized=sum(len(layer["quantized"]) for layer in layers),
        linears_skipped=skipped,
        worst_linear_rel_err=max(errs, default=0.0),
    )
