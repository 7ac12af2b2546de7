"""fp8ptq command line (typer + rich). The only module that prints; each command builds one config
object, calls one library function, renders the result, and exits non-zero on any failure."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fp8ptq.errors import Fp8ptqError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Post-training quantization to compressed-tensors checkpoints for vLLM / SGLang.")
recipes_app = typer.Typer(no_args_is_help=True, help="Built-in recipes.")
eval_app = typer.Typer(no_args_is_help=True, help="Quality under the engine's numerics.")
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
    # No network at run time: never let transformers/datasets reach for a hub.
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(var, "1")


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
        console.print("[red]interrupted; no output was left behind[/]")
        raise typer.Exit(code=130)


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
    overwrite: bool = typer.Option(False, help="replace an existing output directory"),
    json_out: bool = typer.Option(False, "--json", help="print the manifest as JSON on stdout"),
):
    """Calibrate, quantize and export a compressed-tensors checkpoint."""
    _offline()
    _return_freed_memory()
    from fp8ptq.jobs import QuantizeConfig, quantize as run

    cfg = QuantizeConfig(model=model, recipe=recipe, output=output, data=data, text_field=text_field,
                         num_samples=num_samples, seq_len=seq_len, seed=seed, chat_template=chat_template,
                         overwrite=overwrite, eval_samples=eval_samples)
    with _user_errors(), _progress(not json_out) as progress:
        manifest = run(cfg, progress)
    if json_out:
        typer.echo(json.dumps(manifest, indent=2))
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
    t = manifest["timings"]
    table.add_row("time", ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in t.items()))
    out.print(table)


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
):
    """PPL, KL and top-1 agreement vs a reference, under simulated engine numerics."""
    _offline()
    from fp8ptq.jobs import EvalConfig, evaluate_quality

    cfg = EvalConfig(model=model, reference=reference, data=data, text_field=text_field, num_samples=num_samples,
                     seq_len=seq_len, simulate=not no_simulate)
    with _user_errors(), _progress(not json_out) as progress:
        result = evaluate_quality(cfg, progress)
    if json_out:
        typer.echo(json.dumps(result, indent=2))
        return
    table = Table(title=f"quality of {model} vs {reference}", show_header=False)
    _quality_rows(table, result)
    table.add_row("simulated numerics", json.dumps(result["numerics"]))
    out.print(table)


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


def main() -> None:  # pragma: no cover
    sys.exit(app())
