"""fp8ptq command line (typer + rich). The only module that prints; each command builds one config
object, calls one library function, renders the result, and exits non-zero on any failure."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fp8ptq.errors import Fp8ptqError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Post-training quantization to compressed-tensors checkpoints for vLLM / SGLang.")
recipes_app = typer.Typer(no_args_is_help=True, help="Built-in recipes.")
eval_app = typer.Typer(no_args_is_help=True, help="Quality under the engine's numerics: KL/PPL, mmlu_pro, lm-eval tasks.")
app.add_typer(recipes_app, name="recipes")
app.add_typer(eval_app, name="eval")
console = Console(stderr=True)
out = Console()


def _return_freed_memory() -> None:
    """Serve large allocations with mmap so freed calibration activations go back to the OS.

    glibc raises its mmap threshold after each large free, after which GB-sized activations are carved
    from the heap and peak RSS ratchets up with fragmentation. A fixed threshold stops that (CLI
    process only; the library does not touch allocator settings)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def _offline() -> None:
    from fp8ptq.models.loader import ensure_offline

    ensure_offline()


@contextmanager
def _progress(enabled: bool):
    """A rich progress callback (stage, done, total) -> one bar per stage."""
    if not enabled:
        yield None
        return
    with Progress(TextColumn("{task.description:<10}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


@contextmanager
def _user_errors():
    try:
        yield
    except Fp8ptqError as err:
        _fail(err)
    except KeyboardInterrupt:
        console.print("[red]interrupted: no complete output was written[/] (a quantize run keeps its finished "
                      "layers hidden in .OUT.partial: repeat the command with --resume to continue)")
        raise typer.Exit(code=130)


GATE_FAILED_EXIT = 3
_GATE_HELP = "quality gate METRIC OP NUMBER, e.g. kl<=0.05, top1>=0.9 (repeatable); a failed gate exits 3"


def _finish_gates(results: list[dict]) -> None:
    """Print gate results; exit GATE_FAILED_EXIT when any failed (after everything else was printed)."""
    from fp8ptq.gates import GateResult

    if not results:
        return
    failed = 0
    for r in results:
        res = GateResult.from_dict(r)
        console.print(("[green]gate[/] " if r["passed"] else "[bold red]gate[/] ") + res.describe(), highlight=False)
        failed += not r["passed"]
    if failed:
        console.print(f"[bold red]{failed} of {len(results)} quality gates failed[/]")
        raise typer.Exit(code=GATE_FAILED_EXIT)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def _quality_rows(table: Table, q: dict) -> None:
    table.add_row("PPL (reference → quantized)", f"{q['ppl_reference']:.3f} → {q['ppl']:.3f}")
    table.add_row("KL(ref ‖ quant) / token", f"{q['kl']:.5f}")
    table.add_row("top-1 agreement", f"{q['top1'] * 100:.2f}%")
    table.add_row("eval tokens", str(q["tokens"]))


@app.command()
def quantize(
    model: str = typer.Argument(..., help="HF model dir, .gguf file, or alias (smollm2-135m)"),
    recipe: str = typer.Option("fp8-kv8", "--recipe", "-r", help="built-in recipe name or YAML path"),
    output: Path = typer.Option(..., "--output", "-o", help="output directory (written atomically)"),
    data: str = typer.Option("builtin", help="calibration text: builtin, .txt, .jsonl, .parquet or a datasets folder"),
    text_field: str = typer.Option("text", help="field holding the text in .jsonl/.parquet/datasets"),
    num_samples: Optional[int] = typer.Option(None, help="calibration samples (default: the recipe's)"),
    seq_len: Optional[int] = typer.Option(None, help="tokens per calibration sample (default: the recipe's)"),
    seed: Optional[int] = typer.Option(None, help="sample-selection seed (default: the recipe's)"),
    chat_template: bool = typer.Option(False, help="wrap each calibration text in the tokenizer's chat template"),
    eval_samples: int = typer.Option(8, help="held-out samples for the quality check (0 = skip)"),
    gate: List[str] = typer.Option([], "--gate", help=_GATE_HELP),
    no_recipe_gates: bool = typer.Option(False, "--no-recipe-gates", help="ignore the gates the recipe carries"),
    overwrite: bool = typer.Option(False, help="replace an existing output directory (or discard an interrupted run)"),
    resume: bool = typer.Option(False, help="continue an interrupted run of the same command from its last checkpoint"),
    device: str = typer.Option("cpu", help="auto, cpu, cuda or cuda:N (one layer at a time is moved there)"),
    chunk_tokens: int = typer.Option(8192, help="calibration tokens per step: bounds activation memory, not the result"),
    offload_activations: bool = typer.Option(False, help="keep calibration activations on disk (RAM: one chunk)"),
    int4_fraction: Optional[float] = typer.Option(None, help="mixed recipes: share of linear FLOPs at 4 bit"),
    tp: Optional[int] = typer.Option(None, help="flatten recipes: tensor-parallel size the MLP width must divide"),
    draft: str = typer.Option("none", help="auto: also distil a draft from the quantized model, measure it and write "
                                           "speculative_config.json + sglang_flags.txt beside it"),
    draft_trim: Optional[int] = typer.Option(None, help="with --draft auto: also a VocabTrim draft keeping N tokens"),
    draft_steps: int = typer.Option(400, help="with --draft auto: training steps at most"),
    draft_time_budget: Optional[float] = typer.Option(900.0, help="with --draft auto: training seconds at most"),
    json_out: bool = typer.Option(False, "--json", help="print the manifest as JSON on stdout"),
):
    """Calibrate, quantize and export a compressed-tensors checkpoint.

    Under `torchrun --nproc-per-node N -m fp8ptq quantize ...` the calibration samples are split over
    N processes (gloo on CPU, nccl on CUDA) and the result equals a one-process run."""
    _offline()
    _return_freed_memory()
    from fp8ptq.jobs import QuantizeConfig, quantize as run

    cfg = QuantizeConfig(model=model, recipe=recipe, output=output, data=data, text_field=text_field,
                         num_samples=num_samples, seq_len=seq_len, seed=seed, chat_template=chat_template,
                         overwrite=overwrite, eval_samples=eval_samples, gates=tuple(gate),
                         recipe_gates=not no_recipe_gates, resume=resume, device=device, chunk_tokens=chunk_tokens,
                         offload_activations=offload_activations, int4_fraction=int4_fraction, tp=tp, draft=draft,
                         draft_trim=draft_trim, draft_steps=draft_steps, draft_time_budget_s=draft_time_budget)
    with _user_errors(), _progress(not json_out and _is_rank0()) as progress:
        manifest = run(cfg, progress)
    if not manifest:  # a non-zero rank of a torchrun job: rank 0 reports
        return
    if json_out:
        typer.echo(json.dumps(manifest, indent=2))
        _finish_gates(manifest["gates"])
        return
    s = manifest["summary"]
    table = Table(title=f"fp8ptq quantize → {output}", show_header=False)
    table.add_row("model", manifest["model"])
    table.add_row("recipe", manifest["recipe"]["name"])
    table.add_row("decoder layers", str(s["layers"]))
    table.add_row("linears quantized", str(s["linears_quantized"]))
    table.add_row("linears skipped", ", ".join(f"{n} ({why})" for n, why in s["linears_skipped"].items()) or "none")
    table.add_row("ignored (recipe)", ", ".join(manifest["recipe"]["scheme"]["ignore"]) or "none")
    table.add_row("worst linear rel. error", f"{s['worst_linear_rel_err']:.4f}")
    sz = manifest["size_bytes"]
    table.add_row("size", f"{_human(sz['source'])} → {_human(sz['output'])} ({sz['output'] / sz['source']:.2f}×)")
    if manifest.get("quality"):
        _quality_rows(table, manifest["quality"])
    if manifest.get("mixed"):
        table.add_row("4-bit share of linear FLOPs", f"{manifest['mixed']['int4_flop_share'] * 100:.1f}%")
    if manifest.get("speculative"):
        r = manifest["speculative"]["recommendation"]
        table.add_row("speculative decoding", f"draft in {output / 'draft'}: γ={r['gamma']}, τ={r['tau']:.2f}, "
                                              f"c={r['c']:.3f}, predicted {r['speedup']:.2f}× (speculative_config.json)")
    t = manifest["timings"]
    table.add_row("time", ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in t.items()))
    table.add_row("report", str(output / "report.html"))
    out.print(table)
    if manifest["gates_skipped"]:
        console.print(f"[yellow]recipe gates not checked (--eval-samples 0):[/] {', '.join(manifest['gates_skipped'])}")
    _finish_gates(manifest["gates"])


@app.command()
def convert(
    gguf: Path = typer.Argument(..., help=".gguf file"),
    output: Path = typer.Option(..., "--output", "-o"),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32"),
    overwrite: bool = typer.Option(False),
):
    """Dequantize a GGUF file into a Hugging Face safetensors directory."""
    _offline()
    from fp8ptq.jobs import convert as run

    if dtype not in ("bfloat16", "float16", "float32"):
        _fail(Fp8ptqError(f"unknown --dtype '{dtype}'", fix="use bfloat16, float16 or float32"))
    with _user_errors():
        with console.status(f"converting {gguf}"):
            path = run(gguf, output, overwrite, dtype)
    out.print(f"wrote {path}")


_EVAL_OPTS = dict(
    baseline=typer.Option(None, "--baseline", help="reference model (dir, .gguf or alias) for the delta"),
    limit=typer.Option(None, help="questions per (sub)task (default: all)"),
    num_fewshot=typer.Option(None, help="few-shot examples (default: the task's; mmlu_pro: 5)"),
    max_gen_toks=typer.Option(None, help="cap generated tokens (default: the task's; mmlu_pro: 2048)"),
    batch_size=typer.Option(4, help="lm-eval batch size"),
    backend=typer.Option("hf", help="hf (fp32 + simulated engine numerics) or vllm (if installed)"),
    device=typer.Option("cpu", help="hf backend device: cpu, cuda, cuda:N"),
    no_simulate=typer.Option(False, "--no-simulate", help="hf backend: dequantized weights only, no activation/KV quantization"),
    gate=typer.Option([], "--gate", help="gate on '<task>' (percent) or '<task>_delta' (points), e.g. mmlu_pro_delta>=-1.0"),
    json_out=typer.Option(False, "--json"),
    save=typer.Option(None, "--save", help="also write the result JSON to this file"),
    no_record=typer.Option(False, "--no-record", help="do not record the result in an fp8ptq checkpoint's report"),
)


@eval_app.command("quality")
def eval_quality(
    model: str = typer.Argument(..., help="checkpoint to evaluate (any compressed-tensors dir, or plain)"),
    reference: str = typer.Option(..., "--reference", help="reference model (dir, .gguf or alias)"),
    data: str = typer.Option("builtin", help="evaluation text (builtin uses the held-out split)"),
    text_field: str = typer.Option("text"),
    num_samples: int = typer.Option(16),
    seq_len: int = typer.Option(512),
    no_simulate: bool = typer.Option(False, "--no-simulate", help="dequantized weights only, like a plain HF load"),
    json_out: bool = typer.Option(False, "--json"),
    no_record: bool = _EVAL_OPTS["no_record"],
):
    """PPL, KL and top-1 agreement vs a reference, under simulated engine numerics."""
    _offline()
    from fp8ptq.jobs import EvalConfig, evaluate_quality

    cfg = EvalConfig(model=model, reference=reference, data=data, text_field=text_field, num_samples=num_samples,
                     seq_len=seq_len, simulate=not no_simulate)
    with _user_errors(), _progress(not json_out) as progress:
        result = evaluate_quality(cfg, progress)
    if not no_record:
        from fp8ptq.report import save_eval

        save_eval(Path(model), "quality", result)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    table = Table(title=f"quality of {model} vs {reference}", show_header=False)
    _quality_rows(table, result)
    table.add_row("simulated numerics", json.dumps(result["numerics"]))
    out.print(table)


def _harness(name: str, *, tasks, no_simulate: bool, gate, json_out: bool, save, no_record: bool, **fields):
    """Shared body of `eval mmlu_pro` and `eval tasks`: run lm-eval (gates included), record, print.
    `fields` are the HarnessConfig fields the two commands share."""
    _offline()
    from fp8ptq.eval.harness import HarnessConfig, run
    from fp8ptq.report import fmt_num as f, save_eval

    cfg = HarnessConfig(tasks=tuple(tasks), simulate=not no_simulate, gates=tuple(gate), **fields)
    model, baseline = cfg.model, cfg.baseline
    with _user_errors():
        console.print(f"lm-eval: {', '.join(cfg.tasks)} on {model}" + (f", then {baseline}" if baseline else ""), highlight=False)
        result = run(cfg)
    if save:
        save.write_text(json.dumps(result, indent=2) + "\n")
    recorded = None if no_record else save_eval(Path(model), name, result)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
    else:
        table = Table("task", "n", "score ± s.e. (%)", "baseline (%)", "delta [95% CI] (pts)",
                      title=f"{name}: {model}" + (f" vs {baseline}" if baseline else ""))
        for task, r in result["tasks"].items():
            delta = (f"{f(r['delta'], '+.1f')} [{f(r['delta_ci95'][0], '+.1f')}, {f(r['delta_ci95'][1], '+.1f')}]"
                     if "delta" in r else "–")
            table.add_row(task, str(r["n"]), f"{f(r['score'])} ± {f(r['stderr'])}", f(r.get("baseline")), delta,
                          style="bold" if task == result["group"] else None)
        out.print(table)
        console.print(f"numerics: {result['numerics']['backend']}", highlight=False)
        if recorded:
            console.print(f"recorded in {recorded}", highlight=False)
    _finish_gates(result["gates"])


@eval_app.command("mmlu_pro")
def eval_mmlu_pro(
    model: str = typer.Argument(..., help="model to evaluate (fp8ptq/compressed-tensors dir, plain dir, .gguf, alias)"),
    data: Optional[str] = typer.Option(None, help="dir with test + validation files in the MMLU-Pro schema (default: the offline HF cache)"),
    baseline: Optional[str] = _EVAL_OPTS["baseline"], limit: Optional[int] = _EVAL_OPTS["limit"],
    num_fewshot: Optional[int] = _EVAL_OPTS["num_fewshot"], max_gen_toks: Optional[int] = _EVAL_OPTS["max_gen_toks"],
    batch_size: int = _EVAL_OPTS["batch_size"], backend: str = _EVAL_OPTS["backend"], device: str = _EVAL_OPTS["device"],
    no_simulate: bool = _EVAL_OPTS["no_simulate"], gate: List[str] = _EVAL_OPTS["gate"], json_out: bool = _EVAL_OPTS["json_out"],
    save: Optional[Path] = _EVAL_OPTS["save"], no_record: bool = _EVAL_OPTS["no_record"],
):
    """lm-eval's mmlu_pro (5-shot CoT, answer regex) offline, per category, with the delta vs a baseline."""
    _harness("mmlu_pro", tasks=["mmlu_pro"], **locals())


@eval_app.command("tasks")
def eval_tasks(
    model: str = typer.Argument(..., help="model to evaluate"),
    tasks: str = typer.Option(..., "--tasks", help="comma-separated lm-eval task names whose data is local"),
    include_path: Optional[str] = typer.Option(None, help="directory of extra lm-eval task YAMLs"),
    baseline: Optional[str] = _EVAL_OPTS["baseline"], limit: Optional[int] = _EVAL_OPTS["limit"],
    num_fewshot: Optional[int] = _EVAL_OPTS["num_fewshot"], max_gen_toks: Optional[int] = _EVAL_OPTS["max_gen_toks"],
    batch_size: int = _EVAL_OPTS["batch_size"], backend: str = _EVAL_OPTS["backend"], device: str = _EVAL_OPTS["device"],
    no_simulate: bool = _EVAL_OPTS["no_simulate"], gate: List[str] = _EVAL_OPTS["gate"], json_out: bool = _EVAL_OPTS["json_out"],
    save: Optional[Path] = _EVAL_OPTS["save"], no_record: bool = _EVAL_OPTS["no_record"],
):
    """Any lm-eval task with local data (or already in the offline HF datasets cache)."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        _fail(Fp8ptqError("--tasks is empty", fix="pass e.g. --tasks my_task,other_task"))
    opts = {**locals(), "tasks": names}
    del opts["names"]
    _harness("tasks-" + "-".join(names), **opts)


@app.command()
def report(output: Path = typer.Argument(..., help="an fp8ptq quantize output directory")):
    """Re-render OUT/report.md and OUT/report.html from the manifest and recorded evaluations."""
    from fp8ptq.report import MANIFEST, write_report

    if not (output / MANIFEST).is_file():
        _fail(Fp8ptqError(f"'{output}' has no {MANIFEST}", fix="pass a directory written by `fp8ptq quantize`"))
    for p in write_report(output):
        out.print(f"wrote {p}")


@app.command()
def analyze(
    model: str = typer.Argument(..., help="HF model dir, .gguf file, or alias (smollm2-135m)"),
    output: Path = typer.Option(..., "--output", "-o", help="report directory (written atomically)"),
    data: str = typer.Option("builtin", help="text: builtin, .txt, .jsonl, .parquet or a datasets folder"),
    text_field: str = typer.Option("text"),
    num_samples: int = typer.Option(32, help="samples of --seq-len tokens"),
    seq_len: int = typer.Option(512),
    seed: int = typer.Option(0),
    chat_template: bool = typer.Option(False),
    device: str = typer.Option("cpu", help="auto, cpu, cuda or cuda:N"),
    overwrite: bool = typer.Option(False),
    json_out: bool = typer.Option(False, "--json", help="print report.json on stdout"),
):
    """Outlier analysis: per layer and Linear input abs-max, percentiles, kurtosis, outlier channels and
    their stability, massive activations, K/V ranges; report.json + PNG plots + summary.md."""
    _offline()
    from fp8ptq.jobs import AnalyzeConfig, analyze as run

    cfg = AnalyzeConfig(model=model, output=output, data=data, text_field=text_field, num_samples=num_samples,
                        seq_len=seq_len, seed=seed, chat_template=chat_template, overwrite=overwrite, device=device)
    with _user_errors(), _progress(not json_out) as progress:
        rep = run(cfg, progress)
    if json_out:
        typer.echo(json.dumps(rep, indent=2))
        return
    table = Table("layer", "input", "abs-max", "p99", "max/p99", "kurtosis", "outlier ch.", "top channels", "stability",
                  title=f"worst Linear inputs of {model}")
    for w in rep["worst"]:
        table.add_row(str(w["layer"]), w["input"], f"{w['amax']:.3g}", f"{w['p99']:.3g}", f"{w['max_over_p99']:.1f}",
                      f"{w['kurtosis']:.0f}", str(w["outlier_channels"]), ", ".join(map(str, w["top_channels"])),
                      f"{w['stability_mean']:.2f}")
    out.print(table)
    n_massive = sum(bool(l["massive"]) for l in rep["layers"])
    console.print(f"massive activations after {n_massive} of {len(rep['layers'])} layers; report: {output / 'summary.md'}",
                  highlight=False)


ENGINE_FAILED_EXIT = 4


@app.command()
def verify(
    model: str = typer.Argument(..., help="compressed-tensors checkpoint directory"),
    reference: Optional[str] = typer.Option(None, help="unquantized model (default: the one the checkpoint was made from)"),
    prompts: int = typer.Option(4, help="held-out prompts"),
    max_tokens: int = typer.Option(32, help="greedy tokens generated per prompt"),
    dtype: str = typer.Option("float32", help="vLLM compute dtype (float32 isolates quantization from bf16 rounding)"),
    kv_cache_dtype: str = typer.Option("auto", help="auto, or fp8 to use the checkpoint's k/v scales"),
    vllm_python: Optional[str] = typer.Option(None, help="python of a venv with vLLM (default: .venv-vllm, $FP8PTQ_VLLM_PYTHON)"),
    json_out: bool = typer.Option(False, "--json"),
    no_record: bool = _EVAL_OPTS["no_record"],
):
    """Load the checkpoint in real vLLM and compare with fp8ptq's simulated numerics: first layers'
    outputs, greedy agreement, prompt log-probs. Exits 4 if vLLM cannot load or run it (root cause shown)."""
    _offline()
    from fp8ptq.jobs import VerifyConfig, verify as run

    cfg = VerifyConfig(model=model, reference=reference, num_prompts=prompts, max_tokens=max_tokens, dtype=dtype,
                       kv_cache_dtype=kv_cache_dtype, vllm_python=vllm_python)
    with _user_errors():
        with console.status(f"running {model} in vLLM"):
            res = run(cfg)
    if not no_record:
        from fp8ptq.report import save_eval

        save_eval(Path(model), "engine", res)
    if json_out:
        typer.echo(json.dumps(res, indent=2))
    elif res["ok"]:
        a = res["agreement"]
        table = Table(title=f"vLLM vs fp8ptq simulation: {model}", show_header=False)
        for i, e in enumerate(res.get("layer_rel_err", [])):
            table.add_row(f"layer {i} output rel. error (median / max over tokens)", f"{e['median']:.2e} / {e['max']:.2e}")
        table.add_row("greedy: identical prefix (mean tokens)", f"{a['prefix_match_mean']:.1f} of {a['tokens_per_prompt']}")
        table.add_row("greedy: teacher-forced top-1 agreement", f"{a['teacher_forced_agreement'] * 100:.1f}%")
        d = res["logprob_delta"]
        table.add_row("mean |log p| difference to vLLM", ", ".join(f"{k} {v:.4f}" for k, v in d.items()))
        out.print(table)
    if not res["ok"]:
        v = res["vllm"]
        console.print(f"[bold red]vLLM could not run {model}[/] ({v.get('stage')}): {v.get('error')}", highlight=False)
        raise typer.Exit(code=ENGINE_FAILED_EXIT)


@recipes_app.command("list")
def recipes_list():
    """List built-in recipes."""
    from fp8ptq.recipe import builtin_names, load_recipe

    table = Table("name", "description", "needs data")
    for name in builtin_names():
        r = load_recipe(name)
        table.add_row(name, r.description, "yes" if r.needs_data else "no")
    out.print(table)


@recipes_app.command("show")
def recipes_show(name: str):
    """Print a recipe (built-in name or file), validated, as YAML."""
    from fp8ptq.recipe import load_recipe, recipe_yaml

    with _user_errors():
        typer.echo(recipe_yaml(load_recipe(name)), nl=False)  # raw: rich would wrap long lines


from fp8ptq.cli_spec import register as _register_spec  # noqa: E402
_register_spec(app)


def main() -> None:  # pragma: no cover
    sys.exit(app())
