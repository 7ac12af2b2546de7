"""Library entry points for `fp8ptq spec measure` and `fp8ptq spec recommend` (one config, one call each).

measure: held-out prompts (built-in evaluation split, or a file) in the chat template → the speculative
loop for each γ (and dynamic-length thresholds) → acceptance per position and τ per γ, plus the HF
costs (draft step, target over 1..γ_max+1 tokens). recommend: those numbers (measured now, or read
from a measure JSON) → γ, speculative_config.json for vLLM, SGLang flags, recommendation.json, a PNG,
and optionally the memory plan for a device size. engine_check (recommend --engine-check): the chosen
config run in the real engine (vLLM, its own venv) against plain decoding on the same prompts — tokens/s
both ways and vLLM's own acceptance counters, beside fp8ptq's accounting replayed on vLLM's output —
because a speedup predicted from HF timings is not the engine's (batching, kernels, scheduling).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from fp8ptq.errors import check_option
from fp8ptq.results import to_json
from fp8ptq.spec import SpecError
from fp8ptq.spec.acceptance import Measurement, read_measurement
from fp8ptq.spec.config import MeasureConfig, RecommendConfig
from fp8ptq.spec.recommend import (
    MAX_GAMMA,
    OUTPUT_FILES,
    VLLM_SCHEDULE_FIELD,
    Costs,
    RecommendReport,
    choose,
    sglang_flags,
    speedup_from_steps,
    vllm_config,
    with_schedule,
    write_outputs,
)
from fp8ptq.spec.schedule import parse_batch_sizes, per_batch, vllm_ranges

MEASURE_FILE = "measure.json"


def load_any_draft(draft: str, target, device: str = "cpu"):
    """A draft directory, `ngram[:MIN-MAX]`, or an EAGLE-3 head (which runs on top of `target`), loaded by
    the proposer that runs it (proposers.proposer_class)."""
    from fp8ptq.spec.proposers import proposer_class

    return proposer_class(str(draft)).load(draft, target, device)


def check_gammas(gammas) -> None:
    """Every γ in 1..MAX_GAMMA, at least one (SpecError naming them otherwise)."""
    bad = [g for g in gammas if not 1 <= g <= MAX_GAMMA]
    if not gammas or bad:
        raise SpecError(f"γ values {list(gammas)} must be in 1..{MAX_GAMMA}", fix="e.g. --gammas 1,2,3,4,5,6,7,8")


def measure(cfg: MeasureConfig, progress=None) -> Measurement:
    """Acceptance for each temperature and γ + HF costs."""
    from fp8ptq.spec.measure import AcceptancePlan, measure_acceptance, measure_costs
    from fp8ptq.spec.models import load_target
    from fp8ptq.spec.prompts import encode_prompts, load_prompts
    from fp8ptq.spec.proposers import proposer_for

    check_gammas(cfg.gammas)
    sizes = parse_batch_sizes(cfg.batch_sizes) if cfg.batch_sizes else ()  # bad sizes fail before any loading
    if any(t < 0 for t in cfg.temperatures):
        raise SpecError(f"temperatures {list(cfg.temperatures)} must be ≥ 0", fix="0 = greedy, 1 = plain sampling")
    if any(not 0 < t < 1 for t in cfg.thresholds):
        raise SpecError(f"thresholds {list(cfg.thresholds)} must be in (0, 1)", fix="e.g. --thresholds 0.3,0.5")
    check_option("--num-prompts", cfg.num_prompts, minimum=1, maximum=100_000, example=8)
    check_option("--max-tokens", cfg.max_tokens, minimum=1, maximum=1 << 16, example=64)
    t0 = time.perf_counter()
    target, src = load_target(cfg.target, cfg.device)
    draft = load_any_draft(cfg.draft, target, cfg.device)
    proposer = proposer_for(draft)
    proposer.check(target)
    if cfg.prompt_ids is not None:
        prompts = [list(p) for p in cfg.prompt_ids]
    else:
        texts = load_prompts(cfg.prompts, "evaluation", cfg.num_prompts, cfg.seed, cfg.text_field)
        prompts = encode_prompts(src.tokenizer(), texts, max_tokens=cfg.max_prompt_tokens)
    load_s = time.perf_counter() - t0
    by_temperature = {}
    for temp in cfg.temperatures:
        plan = AcceptancePlan(
            tuple(cfg.gammas), cfg.max_tokens, temp, tuple(cfg.thresholds), seed=cfg.seed, device=cfg.device
        )
        by_temperature[str(temp)], _ = measure_acceptance(target, draft, prompts, plan, progress)
    context = prompts[0] + prompts[0][: cfg.max_tokens // 2]  # a typical decode position
    kw = {"max_k": max(cfg.gammas) + 1, "repeats": cfg.cost_repeats, "device": cfg.device, "progress": progress}
    costs = measure_costs(target, draft, context, **kw)
    by_batch = {str(b): costs if b == 1 else measure_costs(target, draft, context, **kw, batch=b) for b in sizes}
    return Measurement(
        target=str(cfg.target),
        target_path=str(src.path),
        draft=str(cfg.draft),
        trimmed=proposer.vocab_trimmed,
        config={k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items() if k != "prompt_ids"},
        prompt_ids=prompts,
        by_temperature=by_temperature,
        costs=costs.as_dict(),
        timings={"load_s": load_s, "total_s": time.perf_counter() - t0},
        costs_by_batch={k: c.as_dict() for k, c in by_batch.items()},
    )


def check_engine_ready(draft: str, python: str | None = None) -> None:
    """Raise SpecError unless `draft` can run in vLLM (a full-vocabulary draft_model, or ngram) and a vLLM
    venv exists."""
    from fp8ptq.engine.vllm import EngineError, vllm_python
    from fp8ptq.spec.models import TRIM_META

    if (Path(draft) / TRIM_META).is_file():
        raise SpecError(
            f"'{draft}' is a vocabulary-trimmed draft: vLLM's draft_model needs the full vocabulary",
            fix="check the full draft (draft-train output); the trimmed one is for SGLang / EAGLE-3 heads",
        )
    try:
        vllm_python(python)
    except EngineError as err:
        raise SpecError(f"--engine-check needs vLLM: {err.message}", fix=err.fix) from None


def sglang_check(flags: list[str]) -> dict:
    """{"version", "ok", "error"}: SGLang's own argument parser over `flags` (fp8ptq/engine/sglang_engine.py);
    ok None, with the reason, where SGLang is not installed (`make sglang`)."""
    from fp8ptq.engine.sglang_engine import run_checks
    from fp8ptq.engine.vllm import EngineError

    try:
        r = run_checks({"flags": {"sglang_flags": flags}})
    except EngineError as err:
        return {"version": None, "ok": None, "error": str(err)}
    return {"version": r["version"], **{k: r["flags"]["sglang_flags"][k] for k in ("ok", "error")}}


def vllm_config_check(target: str, configs: dict[str, dict], *, python: str | None = None) -> dict[str, dict]:
    """name -> {"ok", "error", "resolved"}: vLLM's own EngineArgs -> VllmConfig (its SpeculativeConfig's
    checks) over each speculative config for `target`, in one vLLM process, no weights loaded; "resolved"
    is what vLLM made of it (method, γ, draft model, n-gram sizes)."""
    from fp8ptq.engine.vllm import run_vllm_jobs, vllm_request

    jobs = [vllm_request(Path(target), [], 1, speculative_config=c, validate_only=True) for c in configs.values()]
    runs = run_vllm_jobs(jobs, python=python, timeout_s=300)
    return {name: {"ok": r.ok, "error": r.error, "resolved": r.speculative} for name, r in zip(configs, runs)}


def engine_check(
    target: str,
    draft: str,
    spec_config: dict,
    prompts: list[list[int]],
    max_tokens: int,
    *,
    temperature: float = 0.0,
    seed: int = 0,
    python: str | None = None,
) -> dict:
    """Run `spec_config` in vLLM and plain decoding without it, same prompts (token ids), EOS ignored.
    Returns measured tokens/s both ways and their ratio, vLLM's spec-decode counters and (greedy) the same
    counters from fp8ptq's accounting replayed on vLLM's output (`measure.replay_greedy`). Greedy plain
    decoding runs γ + 1 tokens past max_tokens: the speculative run's last step verifies drafts beyond
    max_tokens, and the replay needs the target's tokens there (taken from the plain run where the two
    runs agree on the first max_tokens). Engine failures are results (ok False, error) — a recommendation
    is still written; bad input raises."""
    from fp8ptq.engine.vllm import run_vllm_jobs, vllm_request

    check_engine_ready(draft, python)
    gamma = int(spec_config["num_speculative_tokens"])
    extra = gamma + 1 if temperature == 0 else 0
    # vLLM's own config classes over the config first (SpeculativeConfig's checks, no weights), then both
    # runs, all in one vLLM process (imported once), each engine warmed up by one short generate before
    # the timed one, so that neither rate carries the engine's first-call cost.
    jobs = {"config": vllm_request(Path(target), [], 1, speculative_config=spec_config, validate_only=True)}
    jobs |= {
        name: vllm_request(
            Path(target), prompts, n, temperature=temperature, seed=seed, speculative_config=cfg, warmup=True
        )
        for name, cfg, n in (("plain", None, max_tokens + extra), ("speculative", spec_config, max_tokens))
    }
    runs = dict(zip(jobs, run_vllm_jobs(list(jobs.values()), python=python)))
    for name, run in runs.items():
        if not run.ok:
            return {"ok": False, "engine": "vllm", "run": name, "error": run.error, "stage": run.stage}
    plain, spec = runs["plain"], runs["speculative"]
    tokens = sum(len(t) for t in spec.token_ids)
    plain_tps = sum(len(t) for t in plain.token_ids) / plain.generate_s
    m = spec.metrics
    drafted, accepted = m.get("vllm:spec_decode_num_draft_tokens", 0), m.get("vllm:spec_decode_num_accepted_tokens", 0)
    out = {
        "ok": True,
        "engine": "vllm",
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "temperature": temperature,
        "tokens": tokens,
        "plain_generate_s": plain.generate_s,
        "speculative_generate_s": spec.generate_s,
        "plain_tokens_per_s": plain_tps,
        "speculative_tokens_per_s": tokens / spec.generate_s,
        "speedup": tokens / spec.generate_s / plain_tps,
        "vllm_config": runs["config"].speculative,  # what vLLM's SpeculativeConfig resolved the config to
        "vllm": {
            "drafts": m.get("vllm:spec_decode_num_drafts", 0),
            "drafted": drafted,
            "accepted": accepted,
            "per_pos_accepted": m.get("vllm:spec_decode_num_accepted_tokens_per_pos"),
            "acceptance": accepted / drafted if drafted else 0.0,
        },
    }
    if temperature == 0:
        replay, same = _replay(target, draft, prompts, (spec.token_ids, plain.token_ids), gamma, max_tokens)
        alpha = replay["acceptance"]
        out["fp8ptq_replay"] = replay
        out["acceptance_gap"] = (out["vllm"]["acceptance"] - alpha) / alpha if alpha else None
        out["outputs_equal_plain"] = same  # prompts whose speculative output == plain greedy output
    return out


def _replay(target: str, draft: str, prompts, streams, gamma: int, max_tokens: int) -> tuple[dict, int]:
    """fp8ptq's greedy accounting replayed on vLLM's speculative output (streams: the speculative and the
    longer plain token ids), and how many prompts came out equal to plain greedy decoding."""
    from fp8ptq.spec.measure import SpecStats, replay_greedy
    from fp8ptq.spec.proposers import proposer_class

    stats, same, tgt = SpecStats(gamma), 0, None
    proposer = proposer_class(str(draft))
    if proposer.reads_target:  # an EAGLE-3 head runs on the target's hidden states (fp8ptq's simulation)
        from fp8ptq.spec.models import load_target

        tgt, _ = load_target(target)
    model = proposer.load(draft, tgt)
    for prompt, stream, longer in zip(prompts, *streams):
        if longer[: len(stream)] == stream:
            stream, same = longer, same + 1
        replay_greedy(model, prompt, stream, gamma=gamma, stats=stats, max_tokens=max_tokens, target=tgt)
    s = stats.summary()
    replay = {"drafts": s.drafts, "drafted": s.drafted, "accepted": s.accepted}
    replay |= {"per_pos_accepted": s.per_pos_accepted, "acceptance": s.alpha}
    return replay, same


def _inputs(cfg: RecommendConfig) -> tuple:
    """The paths a recommendation reads: its output may be none of them, nor hold nor sit inside one."""
    m = cfg.measure
    return (cfg.measured, cfg.token_map, cfg.draft_for_engine) + (() if m is None else (m.target, m.draft, m.prompts))


def _measured(cfg: RecommendConfig, progress) -> Measurement:
    """cfg's measurement (read from --measured, or measured now), after every check that needs none."""
    from fp8ptq.io import check_output

    check_output(Path(cfg.output), cfg.overwrite, _inputs(cfg))
    if cfg.device_memory:
        from fp8ptq.spec.memory import KV_BYTES, parse_size

        parse_size(cfg.device_memory)  # bad input fails before any measuring
        if cfg.kv_dtype != "auto" and cfg.kv_dtype not in KV_BYTES:
            raise SpecError(
                f"unknown KV cache dtype '{cfg.kv_dtype}'", fix=f"use auto or one of {', '.join(sorted(KV_BYTES))}"
            )
    if cfg.engine_check and cfg.measure is not None:
        check_engine_ready(cfg.measure.draft, cfg.vllm_python)  # before minutes of measuring
    if cfg.measured is not None:
        return read_measurement(Path(cfg.measured))
    if cfg.measure is not None:
        return measure(cfg.measure, progress)
    raise SpecError("nothing to recommend from", fix="pass TARGET and DRAFT, or --measured FILE")


def _vllm_check(cfg: RecommendConfig, measured: Measurement, gamma: int, ranges, max_tokens: int) -> dict:
    """The chosen config run in vLLM against plain decoding, on the measured draft's real path
    (draft_for_engine may be relative to a bundle), and a γ-per-batch schedule through vLLM's classes."""
    engine = engine_check(
        measured.target_path,
        measured.draft,
        vllm_config(measured.draft, gamma),
        measured.prompt_ids,
        max_tokens,
        temperature=cfg.temperature,
        seed=int(measured.config.get("seed", 0)),
        python=cfg.vllm_python,
    )
    scheduled = with_schedule(vllm_config(measured.draft, gamma), ranges)
    if VLLM_SCHEDULE_FIELD in scheduled:  # γ per batch size: vLLM's classes and its scheduler's lookup builder
        check = vllm_config_check(measured.target_path, {"schedule": scheduled}, python=cfg.vllm_python)
        engine["vllm_schedule"] = check["schedule"]
    return engine


def _memory_plan(cfg: RecommendConfig, measured: Measurement, gamma: int) -> dict:
    """Where target, draft and KV cache fit on cfg.device_memory (the measured draft's real path)."""
    from fp8ptq.spec.memory import draft_shape, model_shape, parse_size
    from fp8ptq.spec.memory import plan as memory_plan

    return memory_plan(
        model_shape(Path(measured.target_path), cfg.kv_dtype),
        draft_shape(measured.draft),
        parse_size(cfg.device_memory),
        context=cfg.context,
        batch=cfg.batch,
        gamma=gamma,
    ).as_dict()


def recommend(cfg: RecommendConfig, progress=None) -> RecommendReport:
    """Choose γ and write the configs into cfg.output (atomically)."""
    from fp8ptq.io import atomic_output_dir
    from fp8ptq.spec.proposers import proposer_class

    measured = _measured(cfg, progress)
    key = str(float(cfg.temperature))
    if key not in measured.by_temperature:
        raise SpecError(
            f"temperature {cfg.temperature} was not measured (have {sorted(measured.by_temperature)})",
            fix="measure it with --temperatures, or pick a measured one",
        )
    costs = Costs.from_dict(cfg.costs or measured.costs)
    acc = measured.by_temperature[key]
    rec = choose(acc, costs)
    rows, ranges = [], None
    if measured.costs_by_batch and cfg.costs is None:  # γ per batch size (schedule.py)
        rows = per_batch(acc, {int(b): Costs.from_dict(c) for b, c in measured.costs_by_batch.items()})
        ranges = vllm_ranges(rows)
    draft = cfg.draft_for_engine or measured.draft
    # the measured draft's proposer: draft_for_engine may be a path relative to a bundle
    proposer = proposer_class(measured.draft)
    engine, sglang = (None, None)
    if cfg.engine_check:
        engine = _vllm_check(cfg, measured, rec.gamma, ranges, acc.max_tokens)
        # the SGLang flags this writes, parsed by SGLang's own parser where it is installed
        sglang = sglang_check(sglang_flags(draft, rec.gamma, cfg.token_map, proposer=proposer))
    plan = _memory_plan(cfg, measured, rec.gamma) if cfg.device_memory else None
    report = RecommendReport(
        **asdict(rec),
        target=measured.target,
        draft=draft,
        temperature=cfg.temperature,
        memory_plan=plan,
        threshold_runs=[  # each with its predicted speedup under these costs
            {**asdict(r), "speedup": speedup_from_steps(r.steps(), r.emitted, costs)} for r in acc.threshold_runs
        ],
        engine_check=engine,
        sglang_check=sglang,
        token_map=cfg.token_map,  # a trimmed draft's map: recorded, not in the SGLang flags (sglang_flags)
        note=None
        if rec.threshold is None
        else "dynamic draft length is not a vLLM 0.32 draft_model option: the config uses fixed γ",
        files={k: str(Path(cfg.output) / name) for k, name in OUTPUT_FILES.items()},
        per_batch=rows,
        batch_schedule=ranges,
    )
    with atomic_output_dir(Path(cfg.output), cfg.overwrite) as tmp:
        write_outputs(
            tmp,
            report,
            draft=draft,
            token_map=cfg.token_map,
            title=f"{Path(measured.target).name} + {Path(draft).name}, T={cfg.temperature}",
            proposer=proposer,
        )
        (tmp / MEASURE_FILE).write_text(json.dumps(to_json(measured), indent=1) + "\n")
    return report
