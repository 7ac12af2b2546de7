"""`fp8ptq spec compare`: several proposers on one target, one decision (fp8ptq.spec.compare)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from fp8ptq.cli.app import spec_app
from fp8ptq.cli.common import console, offline, out, progress_bar, user_errors
from fp8ptq.cli.fielded import Part, config_command
from fp8ptq.fields import Cli
from fp8ptq.spec.config import MeasureConfig, RecommendConfig

# The measuring options `spec compare` (and `spec recommend --compare`) applies to every proposer alike
COMPARED = ("target", "gammas", "num_prompts", "max_tokens", "seed", "device")


@spec_app.command("compare")
@config_command(
    RecommendConfig,
    only=("output", "temperature", "overwrite", "engine_check", "vllm_python"),
    cli={
        "output": Cli(
            flags=("--output", "-o"), help="folder: comparison.json, the winner's configs, one folder per proposer"
        ),
        "temperature": Cli(help="measure and recommend at this sampling temperature"),
        "engine_check": Cli(
            flags=("--engine-check",), help="run every proposer's config in vLLM: decide on measured tokens/s"
        ),
    },
    part=Part(MeasureConfig, COMPARED),
)
def compare_cmd(
    cfg: RecommendConfig,
    measuring: dict,
    drafts: list[str] = typer.Argument(
        ..., help="two or more: draft dirs, EAGLE-3 heads, ngram[:MIN-MAX], suffix[:N], mtp"
    ),
    json_out: bool = typer.Option(False, "--json"),
):
    """Measure every DRAFT on the same target and prompts, recommend each (its γ and configs), and decide
    which to serve: the highest speedup (vLLM's measured tokens/s with --engine-check, else predicted from
    τ and costs), or none when nothing beats plain decoding. The winner's configs land in OUTPUT.

    \b
    Examples:
      fp8ptq spec compare out/q out/draft ngram suffix -o out/spec-compare
      fp8ptq spec compare out/q out/eagle3 suffix -o out/spec-compare --engine-check
    """
    offline()
    compare_and_print(cfg, measuring, list(drafts), json_out=json_out)


def compare_and_print(cfg: RecommendConfig, measuring: dict, drafts: list[str], *, json_out: bool):
    """Run spec.compare on measuring["target"] with the COMPARED options in `measuring` and cfg's output,
    temperature and engine check, and print its table and decision (also `spec recommend TARGET DRAFT
    --compare DRAFT2 ...`)."""
    from fp8ptq.spec.compare import compare

    target, output = measuring["target"], cfg.output
    shared = {k: measuring[k] for k in COMPARED}

    def recommend_config(draft: str, folder: Path) -> RecommendConfig:
        m = MeasureConfig(**shared, draft=draft, temperatures=(cfg.temperature,))
        return RecommendConfig(
            output=folder,
            measure=m,
            temperature=cfg.temperature,
            engine_check=cfg.engine_check,
            vllm_python=cfg.vllm_python,
        )

    with user_errors(output), progress_bar(not json_out) as progress:
        report = compare(target, drafts, output, recommend_config, overwrite=cfg.overwrite, progress=progress)
    if json_out:
        from fp8ptq.results import to_json

        typer.echo(json.dumps(to_json(report), indent=2))
        return
    temperature = cfg.temperature
    table = Table("draft", "method", "γ", "τ", "α", "c", "predicted", "vLLM", title=f"proposers (T = {temperature})")
    for r in report.proposers:
        v = "—" if r["vllm_speedup"] is None else f"{r['vllm_speedup']:.2f}×"
        c = "—" if r["c"] is None else f"{r['c']:.3f}"
        style = "bold green" if r["draft"] == report.chosen else None
        table.add_row(
            r["draft"],
            r["method"],
            str(r["gamma"]),
            f"{r['tau']:.2f}",
            f"{r['alpha']:.3f}",
            c,
            f"{r['predicted_speedup']:.2f}×",
            v,
            style=style,
        )
    out.print(table)
    console.print(
        ("serve " + report.chosen if report.chosen else "serve without speculation") + ": " + report.why,
        highlight=False,
    )
    out.print(f"comparison: {Path(output) / 'comparison.json'}")
