"""`fp8ptq report`, `fp8ptq push`, `fp8ptq analyze`, `fp8ptq recipes list | show`."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from fp8ptq.api import AnalyzeConfig
from fp8ptq.cli.app import app, recipes_app
from fp8ptq.cli.common import console, fail, human, offline, out, printable, progress_bar, user_errors
from fp8ptq.cli.fielded import config_command
from fp8ptq.errors import Fp8ptqError


@app.command()
def report(output: Path = typer.Argument(..., help="an fp8ptq quantize output directory")):
    """Re-render OUT/report.md, OUT/report.html and the card OUT/README.md from the manifest and recorded evaluations.

    \b
    Examples:
      fp8ptq report out/q
    """
    from fp8ptq.manifest import MANIFEST
    from fp8ptq.report import write_report

    if not (output / MANIFEST).is_file():
        fail(Fp8ptqError(f"'{output}' has no {MANIFEST}", fix="pass a directory written by `fp8ptq quantize`"))
    with user_errors(output):
        written = write_report(output)
    for p in written:
        out.print(f"wrote {p}")


@app.command()
def push(
    output: Path = typer.Argument(..., help="an fp8ptq export (the folder `quantize -o` wrote)"),
    repo_id: str = typer.Argument(..., help="the Hub model repository: NAME or ORG/NAME (created if missing)"),
    private: bool = typer.Option(False, help="create the repository private"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the files and the repository; upload nothing"),
):
    """Upload an export as a Hub model repository (its README.md is the model card).

    Regular files only: hidden files (a run's lock), symlinks and anything outside the folder stay behind.
    The token is huggingface_hub's (`hf auth login` or HF_TOKEN).

    \b
    Examples:
      fp8ptq push out/smollm2-fp8-kv8 me/SmolLM2-135M-FP8-KV8 --dry-run
      fp8ptq push out/smollm2-fp8-kv8 me/SmolLM2-135M-FP8-KV8 --private
    """
    from fp8ptq.export.push import plan_push
    from fp8ptq.export.push import push as upload

    with user_errors():
        plan = plan_push(output, repo_id, private)
    table = Table(
        title=f"fp8ptq push {printable(str(output))} → {printable(repo_id)}" + (" (dry run)" if dry_run else "")
    )
    table.add_column("file")
    table.add_column("size", justify="right")
    for name, size in plan.files:
        table.add_row(printable(name), human(size))
    out.print(table)
    out.print(
        f"{len(plan.files)} files, {human(plan.total_bytes)}"
        + (f"; left out: {', '.join(plan.skipped)}" if plan.skipped else "")
    )
    if dry_run:
        out.print(f"would create '{repo_id}' ({'private' if private else 'public'}, kept if it exists) and upload them")
        return
    with user_errors():
        url = upload(plan)
    out.print(f"pushed: {url}")


@app.command()
@config_command(AnalyzeConfig)
def analyze(cfg: AnalyzeConfig, json_out: bool = typer.Option(False, "--json", help="print report.json on stdout")):
    """Outlier analysis of the float model: where per-tensor scales waste their range.

    Per layer and Linear input: abs-max, percentiles, kurtosis, outlier channels and their stability,
    massive activations, K/V ranges; writes report.json, PNG plots and summary.md.

    \b
    Examples:
      fp8ptq analyze smollm2-135m -o out/analysis
      fp8ptq analyze ./my-model -o out/analysis --data chat.jsonl --device cuda
    """
    offline()
    from fp8ptq.api import analyze as run

    model, output = cfg.model, cfg.output
    with user_errors(output), progress_bar(not json_out) as progress:
        rep = run(cfg, progress)
    if json_out:
        from fp8ptq.results import to_json

        typer.echo(json.dumps(to_json(rep), indent=2))
        return
    table = Table(
        "layer",
        "input",
        "abs-max",
        "p99",
        "max/p99",
        "kurtosis",
        "outlier ch.",
        "top channels",
        "stability",
        title=f"worst Linear inputs of {model}",
    )
    for w in rep.worst:
        table.add_row(
            str(w["layer"]),
            w["input"],
            f"{w['amax']:.3g}",
            f"{w['p99']:.3g}",
            f"{w['max_over_p99']:.1f}",
            f"{w['kurtosis']:.0f}",
            str(w["outlier_channels"]),
            ", ".join(map(str, w["top_channels"])),
            f"{w['stability_mean']:.2f}",
        )
    out.print(table)
    n_massive = sum(bool(l["massive"]) for l in rep.layers)
    console.print(
        f"massive activations after {n_massive} of {len(rep.layers)} layers; report: {output / 'summary.md'}",
        highlight=False,
    )


@recipes_app.command("list")
def recipes_list():
    """List built-in recipes.

    \b
    Examples:
      fp8ptq recipes list
    """
    from fp8ptq.recipe import builtin_names, load_recipe

    table = Table("name", "description", "needs data")
    for name in builtin_names():
        r = load_recipe(name)
        table.add_row(name, r.description, "yes" if r.needs_data else "no")
    out.print(table)


@recipes_app.command("show")
def recipes_show(name: str):
    """Print a recipe (built-in name or file), validated, as YAML.

    \b
    Examples:
      fp8ptq recipes show fp8-kv8 > my-recipe.yaml   # a starting point for your own
    """
    from fp8ptq.recipe import load_recipe
    from fp8ptq.recipe_files import recipe_yaml

    with user_errors():
        typer.echo(recipe_yaml(load_recipe(name)), nl=False)  # raw: rich would wrap long lines
