"""The library's entry points, one per CLI subcommand: each takes one config object, never prints.

quantize: recipe + model + data -> compressed-tensors checkpoint (fp8ptq/workflow.py).
analyze:  outlier statistics of the float model -> report directory.
verify:   a checkpoint in real vLLM vs fp8ptq's simulation.
convert:  GGUF -> HF safetensors directory.
evaluate_quality: any checkpoint vs a reference, under simulated engine numerics.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fp8ptq import data as data_mod
from fp8ptq.calibrate.pipeline import CalibrationSetup, Progress
from fp8ptq.errors import ModelError
from fp8ptq.eval.quality import compare, load_simulated
from fp8ptq.export.atomic import check_output
from fp8ptq.models.loader import convert_gguf, resolve_model
from fp8ptq.workflow import QuantizeConfig, _chunk_samples, quantize, resolve_device  # noqa: F401  (entry points)


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


@dataclass(frozen=True)
class AnalyzeConfig:
    model: str
    output: Path
    data: str = data_mod.BUILTIN
    text_field: str = "text"
    num_samples: int = 32
    seq_len: int = 512
    seed: int = 0
    chat_template: bool = False
    overwrite: bool = False
    device: str = "cpu"
    chunk_tokens: int = 8192


@dataclass(frozen=True)
class VerifyConfig:
    model: str  # a compressed-tensors checkpoint directory
    reference: str | None = None  # default: the model an fp8ptq checkpoint was made from
    num_prompts: int = 4
    prompt_len: int = 96
    max_tokens: int = 32
    dtype: str = "float32"
    kv_cache_dtype: str = "auto"
    vllm_python: str | None = None


def analyze(cfg: AnalyzeConfig, progress: Progress | None = None) -> dict:
    """Outlier analysis of the float model into cfg.output (report.json, PNGs, summary.md), atomically."""
    from fp8ptq.calibrate.analyze import analyze_model
    from fp8ptq.export.atomic import atomic_output_dir
    from fp8ptq.outliers.report import write_analysis

    check_output(cfg.output, cfg.overwrite)
    device = resolve_device(cfg.device)
    src = resolve_model(cfg.model)
    ids = data_mod.load_samples(cfg.data, src.tokenizer(), cfg.num_samples, cfg.seq_len, "calibration", cfg.seed,
                                cfg.text_field, cfg.chat_template)
    setup = CalibrationSetup(None, chunk_samples=_chunk_samples(cfg, ids), device=device)
    with atomic_output_dir(cfg.output, cfg.overwrite) as tmp:
        report, cmax = analyze_model(src, ids, setup, progress=progress)
        report["data"] = "built-in calibration split" if cfg.data == data_mod.BUILTIN else cfg.data
        report["files"] = [p.name for p in write_analysis(tmp, report, cmax)]
    return report


def verify(cfg: VerifyConfig) -> dict:
    """Run a checkpoint in vLLM and compare it with fp8ptq's simulation (eval/engine.py)."""
    from fp8ptq.eval.engine import EngineCheck, check_engine
    from fp8ptq.report import MANIFEST

    src = resolve_model(cfg.model)
    reference = cfg.reference
    manifest = src.path / MANIFEST
    if reference is None and manifest.is_file():
        reference = json.loads(manifest.read_text())["model"]
    ids = data_mod.load_samples(data_mod.BUILTIN, src.tokenizer(), cfg.num_prompts, cfg.prompt_len, "evaluation", 0)
    kv_sim = cfg.kv_cache_dtype.startswith("fp8")
    return check_engine(EngineCheck(model=cfg.model, prompts=tuple(tuple(p) for p in ids.tolist()), reference=reference,
                                    max_tokens=cfg.max_tokens, dtype=cfg.dtype, kv_cache_dtype=cfg.kv_cache_dtype,
                                    simulate_kv=kv_sim, vllm_python=cfg.vllm_python))


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
