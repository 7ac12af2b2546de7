"""`fp8ptq eval quality | mmlu_pro | tasks` and `fp8ptq verify`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fp8ptq.api import EvalConfig, VerifyConfig
from fp8ptq.cli.app import app, eval_app
from fp8ptq.cli.common import (
    ENGINE_FAILED_EXIT,
    EVAL_OPTS,
    check_save,
    console,
    fail,
    finish_gates,
    offline,
    out,
    progress_bar,
    quality_rows,
    record_eval,
    user_errors,
    write_save,
)
from fp8ptq.cli.fielded import config_command
from fp8ptq.errors import Fp8ptqError
from fp8ptq.eval.config import HarnessConfig


@eval_app.command("quality")
@config_command(EvalConfig)
def eval_quality(
    cfg: EvalConfig, json_out: bool = typer.Option(False, "--json"), no_record: bool = EVAL_OPTS["no_record"]
):
    """PPL, KL and top-1 agreement vs a reference, under simulated engine numerics.

    \b
    Examples:
      fp8ptq eval quality out/q --reference smollm2-135m
      fp8ptq eval quality out/q --reference ./my-model --data prose.txt --num-samples 32
      fp8ptq eval quality out/q --reference smollm2-135m --eval-data novel.txt   # in- and off-domain
      fp8ptq eval quality out/q --reference smollm2-135m --engine vllm-gpu   # as a GPU serves it
      fp8ptq eval quality out/q --reference smollm2-135m --recipe-gates   # its recipe's gates
    """
    offline()
    from fp8ptq.api import evaluate_quality

    model, reference = cfg.model, cfg.reference
    with user_errors(), progress_bar(not json_out) as progress:
        result = evaluate_quality(cfg, progress)
    from fp8ptq.results import to_json

    data = to_json(result)
    if not no_record:
        record_eval(model, "quality", data)
    gates = [g.model_dump() for g in result.gates]
    if json_out:
        typer.echo(json.dumps(data, indent=2))
        finish_gates(gates, quiet=True)
        return
    off = result.off_domain
    if off is not None:  # in-domain and off-domain side by side
        table = Table(title=f"quality of {model} vs {reference}")
        table.add_column("")
        table.add_column(f"in-domain ({result.data})", justify="right")
        table.add_column(f"off-domain ({off.data})", justify="right")
        table.add_row("PPL (reference → quantized)", *(f"{q.ppl_reference:.3f} → {q.ppl:.3f}" for q in (result, off)))
        table.add_row("KL(ref ‖ quant) / token", *(f"{q.kl:.5f}" for q in (result, off)))
        table.add_row("top-1 agreement", *(f"{q.top1 * 100:.2f}%" for q in (result, off)))
        table.add_row("eval tokens", *(str(q.tokens) for q in (result, off)))
        table.add_row("simulated numerics", json.dumps(result.numerics), "")
        out.print(table)
        finish_gates(gates)
        return
    table = Table(title=f"quality of {model} vs {reference}", show_header=False)
    quality_rows(table, result)
    table.add_row("simulated numerics", json.dumps(result.numerics))
    out.print(table)
    finish_gates(gates)


def _harness(name: str, cfg: HarnessConfig, *, json_out: bool, save: Path | None, no_record: bool):
    """Shared body of `eval mmlu_pro` and `eval tasks`: run lm-eval (gates included), record, print."""
    offline()
    from fp8ptq.eval.harness import run
    from fp8ptq.report import fmt_num as f
    from fp8ptq.results import to_json

    model, baseline = cfg.model, cfg.baseline
    check_save(save, (model, baseline))
    with user_errors():
        console.print(
            f"lm-eval: {', '.join(cfg.tasks)} on {model}" + (f", then {baseline}" if baseline else ""), highlight=False
        )
        result = run(cfg)
    data = to_json(result)
    write_save(save, data)
    recorded = None if no_record else record_eval(model, name, data)
    if json_out:
        typer.echo(json.dumps(data, indent=2))
    else:
        table = Table(
            "task",
            "n",
            "score ± s.e. (%)",
            "baseline (%)",
            "delta [95% CI] (pts)",
            title=f"{name}: {model}" + (f" vs {baseline}" if baseline else ""),
        )
        for task, r in result.tasks.items():
            delta = (
                f"{f(r.delta, '+.1f')} [{f(r.delta_ci95[0], '+.1f')}, {f(r.delta_ci95[1], '+.1f')}]"
                if r.delta_ci95 is not None
                else "–"
            )
            table.add_row(
                task,
                str(r.n),
                f"{f(r.score)} ± {f(r.stderr)}",
                f(r.baseline),
                delta,
                style="bold" if task == result.group else None,
            )
        out.print(table)
        console.print(f"numerics: {result.numerics['backend']}", highlight=False)
        if recorded:
            console.print(f"recorded in {recorded}", highlight=False)
    finish_gates(data["gates"])


@eval_app.command("mmlu_pro")
@config_command(HarnessConfig, exclude=("tasks", "include_path"))
def eval_mmlu_pro(
    cfg: HarnessConfig,
    json_out: bool = EVAL_OPTS["json_out"],
    save: Optional[Path] = EVAL_OPTS["save"],
    no_record: bool = EVAL_OPTS["no_record"],
):
    """lm-eval's mmlu_pro (5-shot CoT, answer regex) offline, per category, with the delta vs a baseline.

    \b
    Examples:
      fp8ptq eval mmlu_pro out/q --baseline smollm2-135m --data mmlu_pro_dir --limit 20
      fp8ptq eval mmlu_pro out/q --data mmlu_pro_dir --gate mmlu_pro_delta>=-1.0
    """
    _harness("mmlu_pro", cfg, json_out=json_out, save=save, no_record=no_record)


@eval_app.command("tasks")
@config_command(HarnessConfig, exclude=("data",))
def eval_tasks(
    cfg: HarnessConfig,
    json_out: bool = EVAL_OPTS["json_out"],
    save: Optional[Path] = EVAL_OPTS["save"],
    no_record: bool = EVAL_OPTS["no_record"],
):
    """Any lm-eval task with local data (or already in the offline HF datasets cache).

    \b
    Examples:
      fp8ptq eval tasks out/q --tasks my_task --include-path tasks/ --baseline ./my-model
    """
    if not cfg.tasks:
        fail(Fp8ptqError("--tasks is empty", fix="pass e.g. --tasks my_task,other_task"))
    _harness("tasks-" + "-".join(cfg.tasks), cfg, json_out=json_out, save=save, no_record=no_record)


@app.command()
@config_command(VerifyConfig)
def verify(cfg: VerifyConfig, json_out: bool = typer.Option(False, "--json"), no_record: bool = EVAL_OPTS["no_record"]):
    """Load the checkpoint in real vLLM and compare with fp8ptq's simulated numerics.

    Compares the first layers' outputs, greedy agreement and prompt log-probs. Exits 4 if vLLM cannot
    load or run it (root cause shown).

    \b
    Examples:
      fp8ptq verify out/w8a8                      # vLLM from .venv-vllm (make vllm)
      fp8ptq verify out/w4a16-kv8 --kv-cache-dtype fp8 --vllm-python /opt/vllm/bin/python
    """
    offline()
    from fp8ptq.api import verify as run

    model = cfg.model
    with user_errors():
        with console.status(f"running {model} in vLLM"):
            res = run(cfg)
    from fp8ptq.results import to_json

    if not no_record:
        record_eval(model, "engine", to_json(res))
    if json_out:
        typer.echo(json.dumps(to_json(res), indent=2))
    elif res.ok:
        a = res.agreement
        table = Table(title=f"vLLM ({res.dtype}) vs fp8ptq simulation: {model}", show_header=False)
        werr = res.weight_rel_err or {}
        if werr:
            worst = max(werr, key=lambda k: float("inf") if werr[k] is None else werr[k])
            table.add_row(
                "layer-0 weights as vLLM applies them (worst rel. error)",
                f"{worst}: {'not comparable' if werr[worst] is None else format(werr[worst], '.2e')}",
            )
        for i, e in enumerate(res.layer_rel_err or []):
            table.add_row(
                f"layer {i} output rel. error (median / max over tokens)", f"{e['median']:.2e} / {e['max']:.2e}"
            )
        table.add_row(
            "greedy: identical prefix (mean tokens)", f"{a['prefix_match_mean']:.1f} of {a['tokens_per_prompt']}"
        )
        table.add_row("greedy: teacher-forced top-1 agreement", f"{a['teacher_forced_agreement'] * 100:.1f}%")
        d = res.logprob_delta
        table.add_row("mean |log p| difference to vLLM", ", ".join(f"{k} {v:.4f}" for k, v in d.items()))
        out.print(table)
    if not res.ok:
        v = res.vllm
        console.print(f"[bold red]vLLM could not run {model}[/] ({v.get('stage')}): {v.get('error')}", highlight=False)
        if v.get("why"):
            console.print(f"why: {v['why']}", highlight=False)
        raise typer.Exit(code=ENGINE_FAILED_EXIT)
