"""The library's entry points, one per CLI subcommand: each takes one config object, never prints.

quantize: recipe + model + data -> compressed-tensors checkpoint (atomic) with manifest and quality.
convert:  GGUF -> HF safetensors directory.
evaluate_quality: any checkpoint vs a reference, under simulated engine numerics.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import fp8ptq
from fp8ptq import data as data_mod
from fp8ptq.calibrate.pipeline import LayerResult, Progress, QuantizedLinear, calibrate, quantize_weights
from fp8ptq import gates as gates_mod
from fp8ptq.errors import ModelError, RecipeError
from fp8ptq.eval.quality import compare, load_simulated
from fp8ptq.export.atomic import atomic_output_dir, check_output
from fp8ptq.export.compressed_tensors import ShardWriter, compress_linear, ct_scheme, quantization_config
from fp8ptq.models.loader import ModelSource, convert_gguf, open_hf_dir, resolve_model
from fp8ptq.models.skeleton import build_skeleton, decoder_layers
from fp8ptq.quantize.plan import plan_layer
from fp8ptq.recipe import Recipe, load_recipe, recipe_yaml
from fp8ptq.report import write_report



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


@dataclass(frozen=True)
class EvalConfig:
    model: str
    reference: str
    data: str = data_mod.BUILTIN
    text_field: str = "text"
    num_samples: int = 16
    seq_len: int = 512
    seed: int = 0
    simulate: bool = True


def _versions() -> dict:
    import compressed_tensors
    import transformers

    return {"fp8ptq": fp8ptq.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "compressed-tensors": compressed_tensors.__version__, "python": platform.python_version()}


class _CheckpointWriter:
    """Streams one layer at a time into the shard writer; copies everything not quantized as-is."""

    def __init__(self, src: ModelSource, recipe: Recipe, out: Path):
        self.src, self.recipe, self.scheme = src, recipe, ct_scheme(recipe)
        self.shards = ShardWriter(out)
        self.written: set[str] = set()
        self.layers: list[dict] = []

    def _copy(self, name: str) -> None:
        self.shards.add(name, self.src.tensor(name))
        self.written.add(name)

    def layer(self, res: LayerResult) -> None:
        for module, q in res.linears.items():
            tensors = compress_linear(q.weight, q.weight_scale, q.input_scale, self.scheme)
            for k, t in tensors.items():
                self.shards.add(f"{module}.{k}", t)
            self.written.add(f"{module}.weight")
        for name, scale in res.kv_scales.items():
            self.shards.add(name, scale.float().reshape(1))  # shape [1], as compressed-tensors creates them
        for name in self.src.weight_map:
            if name.startswith(res.prefix) and name not in self.written:
                self._copy(name)
        self.layers.append({"index": res.index, "quantized": {m: q.report for m, q in res.linears.items()}, **res.report})

    def finish(self) -> list[str]:
        for name in self.src.weight_map:
            if name not in self.written and not name.startswith("model.layers."):
                self._copy(name)
        return self.shards.close()


def _data_free(src: ModelSource, recipe: Recipe, writer: _CheckpointWriter, progress: Progress | None) -> None:
    """Weight-only work (e.g. fp8-dynamic): per layer, read its weights, quantize, write. No forward."""
    skeleton = build_skeleton(src.config)
    layers = decoder_layers(skeleton)
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}."
        plan = plan_layer(layer, prefix, recipe.scheme.targets, recipe.scheme.ignore)
        res = LayerResult(index=i, prefix=prefix, report={"skipped": {prefix + n: why for n, why in plan.skipped}})
        for group in plan.groups:
            weights = {n: src.tensor(f"{prefix}{n}.weight") for n in group}
            for n, (q, scale, report) in quantize_weights(weights, recipe, None).items():
                res.linears[prefix + n] = QuantizedLinear(q, scale, None, report)
        writer.layer(res)
        if progress:
            progress("quantize", i + 1, len(layers))


def _write_metadata(src: ModelSource, recipe: Recipe, tokenizer, out: Path) -> None:
    config = json.loads((src.path / "config.json").read_text())
    config["quantization_config"] = quantization_config(recipe)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for extra in ("generation_config.json",):
        if (src.path / extra).is_file():
            shutil.copy2(src.path / extra, out / extra)
    tokenizer.save_pretrained(str(out))
    (out / "recipe.yaml").write_text(recipe_yaml(recipe))


def quantize(cfg: QuantizeConfig, progress: Progress | None = None) -> dict:
    """Quantize cfg.model with cfg.recipe into cfg.output. Returns the manifest (also written to disk)."""
    recipe = load_recipe(cfg.recipe)
    check_output(cfg.output, cfg.overwrite)  # fail before any work
    cal = recipe.calibration
    overrides = {k: v for k, v in (("num_samples", cfg.num_samples), ("seq_len", cfg.seq_len), ("seed", cfg.seed)) if v is not None}
    if overrides:
        recipe = recipe.model_copy(update={"calibration": cal.model_copy(update=overrides)})
        cal = recipe.calibration
    gates, gates_skipped = _gates(cfg, recipe)
    t0 = time.perf_counter()
    src = resolve_model(cfg.model)
    tokenizer = src.tokenizer()
    ids = None
    if recipe.needs_data:
        ids = data_mod.load_samples(cfg.data, tokenizer, cal.num_samples, cal.seq_len, "calibration", cal.seed,
                                    cfg.text_field, cfg.chat_template)
    eval_ids = None
    if cfg.eval_samples > 0:
        eval_ids = data_mod.load_samples(data_mod.BUILTIN, tokenizer, cfg.eval_samples, cfg.eval_seq_len, "evaluation", 0)
    timings = {"load_s": time.perf_counter() - t0}
    with atomic_output_dir(cfg.output, cfg.overwrite) as tmp:
        writer = _CheckpointWriter(src, recipe, tmp)
        t1 = time.perf_counter()
        if ids is not None:
            calibrate(src, recipe, ids, writer.layer, progress)
        else:
            _data_free(src, recipe, writer, progress)
        shards = writer.finish()
        timings["quantize_s"] = time.perf_counter() - t1
        _write_metadata(src, recipe, tokenizer, tmp)
        manifest = {
            "model": src.label,
            "recipe": recipe.model_dump(mode="json"),
            "versions": _versions(),
            "calibration": None if ids is None else {"source": cfg.data, "samples": ids.shape[0], "seq_len": ids.shape[1],
                                                     "tokens": ids.numel(), "seed": cal.seed},
            "shards": shards,
            "size_bytes": {"source": src.size_bytes(), "output": sum((tmp / s).stat().st_size for s in shards)},
            "layers": writer.layers,
            "summary": _summary(writer.layers),
        }
        if eval_ids is not None:
            t2 = time.perf_counter()
            quant = load_simulated(open_hf_dir(tmp, label=str(cfg.output)))
            ref = load_simulated(src)
            manifest["quality"] = {**compare(ref.model, quant.model, eval_ids, progress=progress),
                                   "data": "built-in evaluation split", "numerics": quant.numerics}
            timings["eval_s"] = time.perf_counter() - t2
        manifest["timings"] = timings
        manifest["gates"] = [r.as_dict() for r in gates_mod.check(gates, gates_mod.quantize_metrics(manifest))]
        manifest["gates_skipped"] = gates_skipped  # recipe gates that need the quality check, which was off
        (tmp / "fp8ptq_manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        write_report(tmp, manifest, serve_path=str(cfg.output))
    return manifest


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


def convert(gguf: Path, output: Path, overwrite: bool = False, dtype: str = "bfloat16") -> Path:
    if not gguf.is_file() or gguf.suffix != ".gguf":
        raise ModelError(f"'{gguf}' is not a .gguf file", fix="pass the path of a .gguf file")
    check_output(output, overwrite)
    return convert_gguf(gguf, output, getattr(torch, dtype))


def evaluate_quality(cfg: EvalConfig, progress: Progress | None = None) -> dict:
    cand_src, ref_src = resolve_model(cfg.model), resolve_model(cfg.reference)
    tokenizer = ref_src.tokenizer()
    split = "evaluation"
    ids = data_mod.load_samples(cfg.data, tokenizer, cfg.num_samples, cfg.seq_len, split, cfg.seed, cfg.text_field)
    cand = load_simulated(cand_src, simulate=cfg.simulate)
    ref = load_simulated(ref_src, simulate=False)
    result = compare(ref.model, cand.model, ids, progress=progress)
    return {"model": cfg.model, "reference": cfg.reference, **result, "numerics": cand.numerics,
            "data": cfg.data if cfg.data != data_mod.BUILTIN else "built-in evaluation split",
            "config": {k: str(v) for k, v in asdict(cfg).items()}}
