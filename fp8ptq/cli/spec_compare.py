"""`fp8ptq spec compare`: several proposers on one target, one decision (fp8ptq.spec.compare)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from fp8ptq.cli.app import spec_app
from fp8ptq.cli.common import console, expand_home, offline, out, progress_bar, user_errors
from fp8ptq.cli.spec_options import measure_config


@spec_app.command("compare")
def compare_cmd(
    target: str = typer.Argument(..., help="target (quantized checkpoint: measured under simulated engine numerics)"),
    drafts: list[str] = typer.Argument(
        ..., help="two or more: draft dirs, EAGLE-3 heads, ngram[:MIN-MAX], suffix[:N], mtp"
    ),
    output: Path = typer.Option(
        ...,
        "--output",
        "-o",
        callback=expand_home,
        help="folder: comparison.json, the winner's configs, one folder per proposer",
    ),
    gammas: str = typer.Option("1-8", help="γ values: 1-8 or 1,2,4"),
    temperature: float = typer.Option(0.0, help="measure and recommend at this sampling temperature"),
    num_prompts: int = typer.Option(8),
    max_tokens: int = typer.Option(64),
    engine_check: bool = typer.Option(
        False, "--engine-check", help="run every proposer's config in vLLM: decide on measured tokens/s"
    ),
    vllm_python: str = typer.Option(None, help="--engine-check: python of a venv with vLLM (default .venv-vllm)"),
    seed: int = typer.Option(0),
    device: str = typer.Option("cpu"),
    overwrite: bool = typer.Option(False),
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
    opts = dict(gammas=gammas, temperature=temperature, num_prompts=num_prompts, max_tokens=max_tokens)
    opts |= dict(engine_check=engine_check, vllm_python=vllm_python, seed=seed, device=device)
    compare_and_print(target, list(drafts), output, opts, overwrite=overwrite, json_out=json_out)


def compare_and_print(target: str, drafts: list[str], output: Path, opts: dict, *, overwrite: bool, json_out: bool):
    """Run spec.compare with `spec recommend`'s measuring options (opts) and print its table and decision
    (also `spec recommend TARGET DRAFT --compare DRAFT2 ...`)."""
    from fp8ptq.spec.compare import compare
    from fp8ptq.spec.run import RecommendConfig

    def recommend_config(draft: str, folder: Path) -> RecommendConfig:
        m = measure_config(
            target=target,
            draft=draft,
            gammas=opts["gammas"],
            temperatures=str(opts["temperature"]),
            prompts=None,
            num_prompts=opts["num_prompts"],
            max_tokens=opts["max_tokens"],
            thresholds=None,
            seed=opts["seed"],
            device=opts["device"],
        )
        return RecommendConfig(
            output=folder,
            measure=m,
            temperature=opts["temperature"],
            engine_check=opts["engine_check"],
            vllm_python=opts["vllm_python"],
        )

    with user_errors(output), progress_bar(not json_out) as progress:
        report = compare(target, drafts, output, recommend_config, overwrite=overwrite, progress=progress)
    if json_out:
        from fp8ptq.results import to_json

        typer.echo(json.dumps(to_json(report), indent=2))
        return
    temperature = opts["temperature"]
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
