"""The quantize workflow: recipe + model + data -> compressed-tensors checkpoint, written layer by layer into
a resumable hidden directory, with manifest, quality check, gates and report; across torchrun ranks."""

from __future__ import annotations

import json
import platform
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

import fp8ptq
from fp8ptq import data as data_mod
from fp8ptq import gates as gates_mod
from fp8ptq.calibrate.pipeline import CalibrationSetup, LayerResult, Progress, QuantizedLinear, calibrate
from fp8ptq.dist import init_from_env
from fp8ptq.errors import Fp8ptqError, RecipeError
from fp8ptq.eval.quality import compare, load_simulated
from fp8ptq.export.atomic import RunDir, check_output
from fp8ptq.export.compressed_tensors import quantization_config
from fp8ptq.export.writer import CheckpointWriter
from fp8ptq.models.loader import ModelSource, open_hf_dir, resolve_model
from fp8ptq.models.skeleton import build_skeleton, decoder_layers
from fp8ptq.quantize.plan import plan_layer
from fp8ptq.quantize.schemes import LinearScheme, pack_group_fp8, packs_directly, quantize_group
from fp8ptq.recipe import Recipe, load_recipe, recipe_yaml
from fp8ptq.report import write_report


def versions() -> dict:
    import compressed_tensors
    import transformers

    return {"fp8ptq": fp8ptq.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "compressed-tensors": compressed_tensors.__version__, "python": platform.python_version()}


@dataclass(frozen=True)
class QuantizeConfig:
    model: str
    recipe: str
    output: Path
    data: str = data_mod.BUILTIN
    text_field: str = "text"
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


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise Fp8ptqError(f"--device {device}: this torch has no CUDA device", fix="use --device cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        raise Fp8ptqError(f"unknown --device '{device}'", fix="use auto, cpu, cuda or cuda:N")
    return device


def _data_free(src: ModelSource, recipe: Recipe, writer: CheckpointWriter, start: int, on_done, progress) -> None:
    """Weight-only work (RTN, no activation statistics): per layer, read its weights, quantize, write.
    FP8 per-channel / per-tensor weights are packed straight from the source tensors (`pack_group_fp8`,
    the same bytes as the general fp32 fake-quant path, which other schemes take)."""
    layers = decoder_layers(build_skeleton(src.config))
    scheme = LinearScheme(recipe.scheme.weights, recipe.scheme.input_activations)
    direct = packs_directly(recipe.scheme.weights, recipe.calibration)
    with ThreadPoolExecutor(max_workers=1) as pool:  # layer i is written (and fsynced) while i+1 is quantized
        pending = None
        for res in _data_free_layers(src, recipe, layers, scheme, start, direct):
            write = pool.submit(writer.write_layer, *writer.layer_payload(res))
            if pending is not None:
                _finish_layer(pending, on_done, progress, len(layers))
            pending = (res.index, write)
        if pending is not None:
            _finish_layer(pending, on_done, progress, len(layers))


def _finish_layer(pending, on_done, progress, total: int) -> None:
    i, write = pending
    write.result()  # the layer is on disk (or its error is raised here)
    on_done(i)
    if progress:
        progress("quantize", i + 1, total)


def _data_free_layers(src, recipe, layers, scheme, start: int, direct: bool):
    """Each decoder layer from `start` on, quantized (a LayerResult, not yet written)."""
    for i in range(start, len(layers)):
        prefix = f"model.layers.{i}."
        plan = plan_layer(layers[i], prefix, recipe.scheme.targets, recipe.scheme.ignore)
        res = LayerResult(index=i, prefix=prefix, report={"skipped": {prefix + n: why for n, why in plan.skipped}})
        for group in plan.groups:
            weights = {n: src.tensor(f"{prefix}{n}.weight") for n in group}
            if direct:
                for n, packed in pack_group_fp8(weights, recipe.scheme.weights).items():
                    res.packed[prefix + n] = packed
                continue
            for n, qw in quantize_group(weights, recipe.scheme.weights, recipe.calibration, None).items():
                res.linears[prefix + n] = QuantizedLinear(qw.fake, qw.params, scheme, qw.report)
        yield res


def _write_metadata(src: ModelSource, recipe: Recipe, tokenizer, out: Path, config_updates: dict | None = None,
                    groups=None) -> None:
    config = json.loads((src.path / "config.json").read_text())
    config.update(config_updates or {})
    config["quantization_config"] = quantization_config(recipe, groups)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("generation_config.json",):
        if (src.path / extra).is_file():
            shutil.copy2(src.path / extra, out / extra)
    tokenizer.save_pretrained(str(out))
    (out / "recipe.yaml").write_text(recipe_yaml(recipe))


def _fingerprint(src: ModelSource, recipe: Recipe, ids: torch.Tensor | None, cfg: QuantizeConfig, world: int) -> dict:
    """What a resumed run must share with the interrupted one for the result to be the same."""
    import hashlib

    return {"model": src.label, "model_bytes": src.size_bytes(), "fp8ptq": fp8ptq.__version__,
            "recipe": recipe.model_dump(mode="json"),
            "calibration_data": None if ids is None else hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
            "chunk_tokens": cfg.chunk_tokens, "world_size": world}


def _open_run(cfg: QuantizeConfig, comm, fingerprint: dict) -> tuple[RunDir | None, dict]:
    """Rank 0 opens (or resumes) the run directory; every rank gets its state (or rank 0's error)."""
    run, msg = None, None
    if comm.rank == 0:
        run = RunDir(cfg.output, overwrite=cfg.overwrite, resume=cfg.resume, fingerprint=fingerprint)
        try:
            run.__enter__()
            msg = ("ok", run.state, run.resumed, str(run.path))
        except Fp8ptqError as err:
            msg = ("error", err.message, err.fix, type(err).__name__)
            if comm.world == 1:
                raise
    msg = comm.broadcast_object(msg)
    if msg[0] == "error":
        raise Fp8ptqError(msg[1], fix=msg[2])
    return run, {"state": msg[1], "resumed": msg[2], "path": Path(msg[3])}


def quantize(cfg: QuantizeConfig, progress: Progress | None = None) -> dict:
    """Quantize cfg.model with cfg.recipe into cfg.output. Returns the manifest (also written to disk).

    Under torchrun (WORLD_SIZE > 1) every rank calibrates its share of the samples, statistics are
    combined exactly, and rank 0 writes the output; the manifest is returned on rank 0 (others: {})."""
    recipe = load_recipe(cfg.recipe)
    check_output(cfg.output, cfg.overwrite)  # fail before any work
    device = resolve_device(cfg.device)
    cal = recipe.calibration
    overrides = {k: v for k, v in (("num_samples", cfg.num_samples), ("seq_len", cfg.seq_len), ("seed", cfg.seed)) if v is not None}
    if overrides:
        recipe = recipe.model_copy(update={"calibration": cal.model_copy(update=overrides)})
        cal = recipe.calibration
    recipe = _recipe_overrides(cfg, recipe)
    if cfg.draft not in ("none", "auto"):
        raise RecipeError(f"unknown --draft '{cfg.draft}'", fix="use --draft auto (train a draft) or none")
    gates, gates_skipped = _gates(cfg, recipe)
    comm = init_from_env(device)
    t0 = time.perf_counter()
    src = resolve_model(cfg.model)
    _check_group_sizes(src, recipe)
    tokenizer = src.tokenizer()
    ids = None
    if recipe.needs_data:
        ids = data_mod.load_samples(cfg.data, tokenizer, cal.num_samples, cal.seq_len, "calibration", cal.seed,
                                    cfg.text_field, cfg.chat_template)
    timings = {"load_s": time.perf_counter() - t0}
    run, info = _open_run(cfg, comm, _fingerprint(src, recipe, ids, cfg, comm.world))
    try:
        manifest = _quantize_into(cfg, recipe, src, tokenizer, ids, comm, run, info, device, timings, progress)
        if run is not None:
            manifest["gates"] = [r.as_dict() for r in gates_mod.check(gates, gates_mod.quantize_metrics(manifest))]
            manifest["gates_skipped"] = gates_skipped  # recipe gates that need the quality check, which was off
            (run.path / "fp8ptq_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
            write_report(run.path, manifest, serve_path=str(cfg.output))
            CheckpointWriter(src, run.path).cleanup()
            run.commit()
    finally:
        if run is not None:
            run.__exit__(*sys.exc_info())
    return manifest if run is not None else {}


def _quantize_into(cfg, recipe, src, tokenizer, ids, comm, run, info, device, timings, progress) -> dict:
    """The body of quantize() inside the (possibly resumed) run directory."""
    path, state = info["path"], info["state"]
    writer = CheckpointWriter(src, path) if comm.rank == 0 else None
    start = state.get("checkpoint", 0)
    layers_total = src.config.num_hidden_layers
    t1 = time.perf_counter()
    if start < layers_total:
        if ids is None:  # data-free: nothing to share between ranks, rank 0 does it
            if comm.rank == 0:
                _data_free(src, recipe, writer, start, lambda i: run.save_state(layers_done=i + 1, checkpoint=i + 1), progress)
        else:
            _calibrate_run(cfg, recipe, src, ids, comm, run, writer, path, start, device, progress)
    timings["quantize_s"] = time.perf_counter() - t1
    if comm.rank != 0:
        return {}
    layers = writer.reports()
    shards = state.get("shards")  # a resumed run that had already assembled its shards
    if not shards:
        t2 = time.perf_counter()
        shards = writer.finish(layers_total)
        run.save_state(shards=shards)
        timings["assemble_s"] = time.perf_counter() - t2  # non-layer tensors, shard names, index
    _write_metadata(src, recipe, tokenizer, path, _config_updates(layers), _export_groups(recipe, layers, run.state))
    manifest = {
        "model": src.label,
        "recipe": recipe.model_dump(mode="json"),
        "versions": versions(),
        "calibration": None if ids is None else {"source": cfg.data, "samples": ids.shape[0], "seq_len": ids.shape[1],
                                                 "tokens": ids.numel(), "seed": recipe.calibration.seed},
        "run": {"device": device, "world_size": comm.world, "resumed_from_layer": start if info["resumed"] else None,
                "offload_activations": cfg.offload_activations, "chunk_tokens": cfg.chunk_tokens,
                "chunks_per_rank": None if ids is None else _chunks_per_rank(cfg, ids, comm.world)},
        "shards": shards,
        "size_bytes": {"source": src.size_bytes(), "output": sum((path / s).stat().st_size for s in shards)},
        "layers": layers,
        "summary": _summary(layers),
    }
    if recipe.mixed is not None:
        manifest["mixed"] = run.state["mixed"]["report"]
    if cfg.draft == "auto":  # the finished target is in place: distil, measure, recommend beside it
        from fp8ptq.spec.auto import build_draft_bundle

        t3 = time.perf_counter()
        manifest["speculative"] = build_draft_bundle(path, path, trim_keep=cfg.draft_trim, max_steps=cfg.draft_steps,
                                                     time_budget_s=cfg.draft_time_budget_s, device=device,
                                                     progress=progress)
        timings["draft_s"] = time.perf_counter() - t3
    if cfg.eval_samples > 0:
        t2 = time.perf_counter()
        eval_ids = data_mod.load_samples(data_mod.BUILTIN, tokenizer, cfg.eval_samples, cfg.eval_seq_len, "evaluation", 0)
        quant = load_simulated(open_hf_dir(path, label=str(cfg.output)), device=device)
        ref = load_simulated(src, device=device)
        manifest["quality"] = {**compare(ref.model, quant.model, eval_ids.to(device), progress=progress),
                               "data": "built-in evaluation split", "numerics": quant.numerics}
        del quant, ref
        timings["eval_s"] = time.perf_counter() - t2
    manifest["timings"] = timings
    return manifest


def _mixed_low(recipe, src, ids, setup, comm, run, progress) -> set[str]:
    """The modules at the low-bit scheme: planned once, kept in the run state so a resumed run reuses it."""
    from dataclasses import replace

    from fp8ptq.calibrate.mixed import plan_mixed

    state = run.state if run is not None else None
    known = comm.broadcast_object(None if state is None else state.get("mixed"))
    if known is not None:
        return set(known["low"])
    plan = plan_mixed(src, recipe, ids, replace(setup, start_layer=0, restore=None), comm, progress)
    if run is not None:
        run.save_state(mixed={"low": sorted(plan.low), "report": plan.report})
    return set(plan.low)


def _export_groups(recipe: Recipe, layers: list[dict], state: dict):
    """(scheme, module names) per compressed-tensors config group; None: the recipe's single group."""
    if recipe.mixed is None:
        return None
    low = set(state["mixed"]["low"])
    names = sorted(n for l in layers for n in l["quantized"])
    high = LinearScheme(recipe.scheme.weights, recipe.scheme.input_activations)
    groups = [(high, [n for n in names if n not in low])]
    if low:
        groups.append((LinearScheme(recipe.mixed.weights, recipe.mixed.input_activations), sorted(low)))
    return [g for g in groups if g[1]]


def _config_updates(layers: list[dict]) -> dict:
    """config.json changes made by transforms: FlattenQuant widens every layer's MLP the same way."""
    widths = {l["transforms"]["flatten"]["width"] for l in layers if l.get("transforms", {}).get("flatten")}
    assert len(widths) <= 1, f"layers flattened to different widths: {widths}"
    return {"intermediate_size": widths.pop()} if widths else {}


def _chunk_samples(cfg, ids: torch.Tensor) -> int:
    return max(1, cfg.chunk_tokens // ids.shape[1])


def _chunks_per_rank(cfg: QuantizeConfig, ids: torch.Tensor, world: int) -> list[int]:
    from fp8ptq.dist import ChunkPlan

    plan = ChunkPlan(ids.shape[0], _chunk_samples(cfg, ids), 0, world)
    return [len(plan.owned(r)) for r in range(world)]


def _calibrate_run(cfg, recipe, src, ids, comm, run, writer, path, start, device, progress) -> None:
    chunk_samples = _chunk_samples(cfg, ids)
    idle = [r for r, n in enumerate(_chunks_per_rank(cfg, ids, comm.world)) if n == 0]
    if idle:
        raise Fp8ptqError(f"{ids.shape[0]} samples in chunks of {chunk_samples} leave ranks {idle} of {comm.world} without work",
                          fix="use fewer processes, more --num-samples, or a smaller --chunk-tokens")
    resume_dir = path / "resume"
    restore = resume_dir / f"hidden.rank{comm.rank}.bin" if start > 0 else None
    setup = CalibrationSetup(recipe, chunk_samples=chunk_samples, device=device,
                             offload_dir=resume_dir if cfg.offload_activations else None,
                             start_layer=start, restore=restore)
    last = {"t": time.monotonic()}

    def on_layer(res: LayerResult, st) -> None:
        if writer is not None:
            writer.layer(res)
        i = res.index
        due = (st.store.nbytes <= 256 << 20 or time.monotonic() - last["t"] >= cfg.checkpoint_every_s
               or i + 1 == src.config.num_hidden_layers)
        if due:  # every rank saves its own activations, then rank 0 records the checkpoint
            resume_dir.mkdir(exist_ok=True)
            st.store.save(resume_dir / f"hidden.rank{comm.rank}.bin")
            last["t"] = time.monotonic()
        comm.barrier()
        if run is not None:
            run.save_state(layers_done=i + 1, **({"checkpoint": i + 1} if due else {}))

    from fp8ptq.calibrate.transforms import make_transforms

    layer_schemes = None
    if recipe.mixed is not None:
        low = _mixed_low(recipe, src, ids, setup, comm, run, progress)
        high = LinearScheme(recipe.scheme.weights, recipe.scheme.input_activations)
        low_scheme = LinearScheme(recipe.mixed.weights, recipe.mixed.input_activations)

        def mixed_schemes(i, plan):
            return {g: low_scheme if plan.prefix + g[0] in low else high for g in plan.groups}

        layer_schemes = mixed_schemes

    calibrate(src, recipe, ids, on_layer, progress, setup, comm, transforms=make_transforms(recipe, src),
              layer_schemes=layer_schemes)
    comm.barrier()
    if run is not None:
        shutil.rmtree(resume_dir, ignore_errors=True)


def _check_group_sizes(src: ModelSource, recipe: Recipe) -> None:
    """Before any work: a group size must divide the input width of every Linear it will quantize
    (after flattening, for down_proj)."""
    from fp8ptq.ops.intq import valid_group_sizes

    args = [a for a in (recipe.scheme.weights, recipe.mixed.weights if recipe.mixed else None) if a is not None]
    sizes = {a.group_size for a in args if a.group_size}
    if not sizes:
        return
    layer = decoder_layers(build_skeleton(src.config))[0]
    plan = plan_layer(layer, "model.layers.0.", recipe.scheme.targets, recipe.scheme.ignore)
    modules = dict(layer.named_modules())
    widths = {n: modules[n].in_features for n in plan.modules}
    if recipe.flatten is not None and "mlp.down_proj" in widths:
        from fp8ptq.outliers.flatten import flattened_width

        f = recipe.flatten
        widths["mlp.down_proj"] = flattened_width(widths["mlp.down_proj"], f.extra_channels, f.multiple, f.tp)
    common = sorted(set.intersection(*(set(valid_group_sizes(w)) for w in widths.values())))
    for size in sizes:
        bad = sorted({f"{n} ({w})" for n, w in widths.items() if w % size})
        if bad:
            raise RecipeError(f"group_size {size} does not divide the input width of {', '.join(bad)}",
                              fix=f"use a group size that divides every quantized layer: {', '.join(map(str, common))}")


def _recipe_overrides(cfg: QuantizeConfig, recipe: Recipe) -> Recipe:
    """--int4-fraction / --tp change the recipe's mixed / flatten sections (validated like the YAML)."""
    from fp8ptq.recipe import parse_recipe

    data = recipe.model_dump(mode="json")
    for value, section, key, flag in ((cfg.int4_fraction, "mixed", "int4_fraction", "--int4-fraction"),
                                      (cfg.tp, "flatten", "tp", "--tp")):
        if value is None:
            continue
        if data.get(section) is None:
            raise RecipeError(f"{flag} needs a recipe with a '{section}' section; '{recipe.name}' has none",
                              fix=f"drop {flag} or use a recipe such as {'mixed-w4-w8' if section == 'mixed' else 'flatten-w8a8'}")
        data[section][key] = value
    return parse_recipe(data, f"{recipe.name} with command-line overrides")


def _gates(cfg: QuantizeConfig, recipe: Recipe) -> tuple[list[gates_mod.Gate], list[str]]:
    """(gates to check, recipe gates skipped), checked before any work. A gate on a quality metric needs the
    quality check: asked for with --gate it is an error without one; a recipe's own is skipped and reported."""
    known = gates_mod.QUANTIZE_METRICS
    gates, skipped = [], []
    for g, from_recipe in [(g, True) for g in (recipe.gates if cfg.recipe_gates else ())] + [(g, False) for g in cfg.gates]:
        g = gates_mod.parse_gate(g)
        if g.metric not in known:
            raise RecipeError(f"gate '{g}': quantize has no metric '{g.metric}'",
                              fix=f"quantize gates use {', '.join(sorted(known))}; task scores are gated by `fp8ptq eval`")
        if g.metric in gates_mod.QUALITY_METRICS and cfg.eval_samples == 0:
            if from_recipe:
                skipped.append(str(g))
                continue
            raise RecipeError(f"gate '{g}' needs the quality check, but --eval-samples is 0",
                              fix="keep --eval-samples > 0 (default 8)")
        gates.append(g)
    return gates, skipped


def _summary(layers: list[dict]) -> dict:
    quantized = sum(len(l["quantized"]) for l in layers)
    skipped = {}
    for l in layers:
        for name, why in l.get("skipped", {}).items():
            skipped[name] = why
    errs = [r.get("output_rel_err", r["weight_rel_err"]) for l in layers for r in l["quantized"].values()]
    return {"layers": len(layers), "linears_quantized": quantized, "linears_skipped": skipped,
            "worst_linear_rel_err": max(errs, default=0.0)}
