"""Speculative-decoding commands: spec measure / recommend / memory.

Like the rest of the CLI: each command builds one config object, calls one library function
(fp8ptq.spec.*), prints, exits 2 on bad input.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fp8ptq.cli.app import spec_app
from fp8ptq.cli.common import (
    check_save,
    console,
    expand_home,
    fail,
    human,
    offline,
    out,
    progress_bar,
    user_errors,
    write_save,
)
from fp8ptq.cli.fielded import Part, config_command
from fp8ptq.errors import Fp8ptqError
from fp8ptq.fields import Cli
from fp8ptq.spec.config import MeasureConfig, RecommendConfig


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def _acceptance_table(measured, costs: dict | None) -> None:
    """The tables of a spec.run.Measurement: per temperature, a row per γ and per threshold."""
    from fp8ptq.spec.recommend import Costs, speedup_from_steps

    c = Costs.from_dict(costs) if costs else None
    for temp, r in measured.by_temperature.items():
        cols = ("γ", "τ ± s.e.", "α (all)", "α per position", "α given the previous")
        table = Table(*cols, "pred. speedup" if c else "", title=f"T = {temp}")
        for run in r.runs:
            s = speedup_from_steps(run.steps(), run.emitted, c) if c else None
            table.add_row(
                str(run.gamma),
                f"{run.tau:.2f}" + (f" ± {run.tau_se:.2f}" if run.tau_se is not None else ""),
                f"{run.alpha:.3f}",
                " ".join(f"{a:.2f}" for a in run.alpha_per_pos),
                " ".join(f"{a:.2f}" for a in run.alpha_conditional),
                f"{s:.2f}×" if s else "",
            )
        for run in r.threshold_runs:
            s = speedup_from_steps(run.steps(), run.emitted, c) if c else None
            table.add_row(
                f"≤{run.gamma}, t={run.threshold}",
                f"{run.tau:.2f}",
                f"{run.alpha:.3f}",
                "drafted/step " + f"{run.drafted / max(1, run.target_forwards):.2f}",
                "",
                f"{s:.2f}×" if s else "",
            )
        out.print(table)
    if c:
        v = " ".join(f"{k}:{x / c.t_target:.2f}" for k, x in sorted(c.t_verify.items()))
        console.print(
            f"costs ({c.source}): target {c.t_target * 1e3:.1f} ms/token, draft {c.t_draft * 1e3:.1f} ms "
            f"(c = {c.c:.3f}); target over k tokens / 1 token: {v}",
            highlight=False,
        )


@spec_app.command("measure")
@config_command(MeasureConfig)
def measure_cmd(
    cfg: MeasureConfig,
    save: Optional[Path] = typer.Option(
        None, "--save", callback=expand_home, help="write the measurements (JSON) for `spec recommend --measured`"
    ),
    json_out: bool = typer.Option(False, "--json"),
):
    """Acceptance per draft position, τ per γ, and the costs of draft and target steps.

    \b
    Examples:
      fp8ptq spec measure out/q out/draft --temperatures 0,1 --save out/measure.json
      fp8ptq spec measure out/q ngram:2-4
      fp8ptq spec measure out/q suffix
      fp8ptq spec measure out/deepseek-v3-fp8 mtp
    """
    offline()
    from fp8ptq.spec.run import measure

    check_save(save, (cfg.target, cfg.draft))
    with user_errors(), progress_bar(not json_out) as progress:
        result = measure(cfg, progress)
    from fp8ptq.results import to_json

    write_save(save, to_json(result), indent=1)
    if json_out:
        _echo_json(to_json(result))
        return
    _acceptance_table(result, result.costs)


@spec_app.command("recommend")
@config_command(
    RecommendConfig,
    exclude=("measure",),
    part=Part(
        MeasureConfig,
        ("target", "draft", "gammas", "num_prompts", "max_tokens", "thresholds", "batch_sizes", "seed", "device"),
        cli={
            "target": Cli(argument=True, default=None, help="target (omit with --measured)"),
            "draft": Cli(
                argument=True, default=None, help="draft dir, ngram[:MIN-MAX], suffix[:N] or mtp (omit with --measured)"
            ),
        },
    ),
)
def recommend_cmd(
    cfg: RecommendConfig,
    measuring: dict,
    compare_with: list[str] = typer.Option(
        [], "--compare", help="also measure this proposer (repeatable) and decide between all: `spec compare`"
    ),
    json_out: bool = typer.Option(False, "--json"),
):
    """Choose γ maximising τ·T_t / (γ·T_d + T_v(γ+1)); write vLLM and SGLang configs and a plot.
    With --compare: every proposer measured, each one's γ, α, c and speedup listed, and which to serve.

    \b
    Examples:
      fp8ptq spec recommend out/q out/draft -o out/spec --engine-check
      fp8ptq spec recommend --measured out/measure.json -o out/spec --device-memory 24GiB
      fp8ptq spec recommend out/q out/draft --compare ngram --compare suffix -o out/spec
      fp8ptq spec recommend out/q out/draft --batch-sizes 1,8,32 -o out/spec --device cuda
    """
    offline()
    target, draft, output = measuring["target"], measuring["draft"], cfg.output
    if compare_with:
        from fp8ptq.cli.spec_compare import compare_and_print

        if cfg.measured is not None or target is None or draft is None:
            fail(
                Fp8ptqError(
                    "--compare measures every proposer: it needs TARGET and DRAFT, not --measured",
                    fix="e.g. fp8ptq spec recommend out/q out/draft --compare ngram -o out/spec",
                )
            )
        compare_and_print(cfg, measuring, [draft, *compare_with], json_out=json_out)
        return
    from fp8ptq.spec.run import recommend

    if cfg.measured is None and (target is None or draft is None):
        fail(
            Fp8ptqError(
                "spec recommend needs TARGET and DRAFT, or --measured FILE",
                fix="e.g. fp8ptq spec recommend out/q out/draft -o out/spec",
            )
        )
    if cfg.measured is None:
        cfg = replace(cfg, measure=MeasureConfig(**measuring, temperatures=(cfg.temperature,)))
    with user_errors(output), progress_bar(not json_out) as progress:
        rec = recommend(cfg, progress)
    if json_out:
        from fp8ptq.results import to_json

        _echo_json(to_json(rec))
        return
    table = Table("γ", "τ", "α", "predicted speedup", title=f"recommendation (T = {cfg.temperature})")
    for row in rec.table:
        table.add_row(
            str(row["gamma"]),
            f"{row['tau']:.2f}",
            f"{row['alpha']:.3f}",
            f"{row['speedup']:.2f}×",
            style="bold green" if row["gamma"] == rec.gamma else None,
        )
    out.print(table)
    c = rec.costs
    console.print(
        f"c = {c['c']:.3f} ({c['source']}); chosen γ = {rec.gamma}, predicted {rec.speedup:.2f}×"
        + ("" if rec.worth_it else " — no γ beats plain decoding with these costs"),
        highlight=False,
    )
    if rec.threshold is not None:
        console.print(
            f"dynamic draft length t={rec.threshold} measured {rec.threshold_speedup:.2f}× "
            "(not expressible in vLLM 0.32's draft_model config)",
            highlight=False,
        )
    if rec.per_batch:
        ranges = ", ".join(f"{a}-{b}: γ {g}" for a, b, g in rec.batch_schedule)
        console.print(f"γ per batch size (vLLM num_speculative_tokens_per_batch_size): {ranges}", highlight=False)
    if rec.engine_check:
        _engine_line(rec.engine_check)
    if rec.memory_plan:
        _memory_table(rec.memory_plan)
    for k, p in rec.files.items():
        out.print(f"{k:>15}: {p}")
    out.print(
        "vLLM:   vllm serve TARGET --speculative-config "
        + Path(rec.files["vllm"]).read_text().strip().replace("\n", "")
    )
    out.print(
        "SGLang: python -m sglang.launch_server --model-path TARGET " + Path(rec.files["sglang"]).read_text().strip()
    )


@spec_app.command("memory")
def memory_cmd(
    target: str = typer.Argument(..., help="target model dir"),
    draft: Optional[str] = typer.Argument(
        None, help="draft model dir, or ngram / suffix / mtp (no separate draft weights); omit: no speculation"
    ),
    device_memory: str = typer.Option(..., "--device-memory", help="e.g. 24GiB, 80GB"),
    context: int = typer.Option(4096),
    batch: int = typer.Option(1),
    gamma: int = typer.Option(4),
    kv_dtype: str = typer.Option("auto", help="auto, bf16, fp16, fp32, fp8"),
    utilization: float = typer.Option(0.9, help="fraction of device memory the engine may use"),
    json_out: bool = typer.Option(False, "--json"),
):
    """Bytes of weights and KV cache; the largest context / batch that fit, with and without the draft.

    \b
    Examples:
      fp8ptq spec memory out/q out/draft --device-memory 24GiB --context 8192
      fp8ptq spec memory out/q ngram --device-memory 24GiB   # no draft weights: the plain plan
    """
    offline()
    from fp8ptq.models.loader import resolve_model
    from fp8ptq.spec.memory import draft_shape, model_shape, parse_size, plan

    with user_errors():
        size = parse_size(device_memory)
        t = model_shape(resolve_model(target).path, kv_dtype)
        d = draft_shape(draft, kv_dtype if kv_dtype != "auto" else t.kv_dtype)
        p = plan(t, d, size, context=context, batch=batch, gamma=gamma, utilization=utilization).as_dict()
    if json_out:
        _echo_json(p)
        return
    _memory_table(p)


def _engine_line(e: dict) -> None:
    if not e["ok"]:
        console.print(
            f"[yellow]engine check: vLLM failed in the {e['run']} run ({e['stage']}): {e['error']}[/yellow]",
            highlight=False,
        )
        return
    v = e["vllm"]
    line = (
        f"vLLM measured ({e['prompts']} prompts × {e['max_tokens']} tokens): "
        f"plain {e['plain_tokens_per_s']:.1f} tok/s, "
        f"speculative {e['speculative_tokens_per_s']:.1f} tok/s = {e['speedup']:.2f}×; vLLM accepted "
        f"{v['accepted']}/{v['drafted']} = {v['acceptance']:.3f}"
    )
    if e.get("fp8ptq_replay"):
        r = e["fp8ptq_replay"]
        line += f", fp8ptq's accounting on vLLM's output {r['accepted']}/{r['drafted']} = {r['acceptance']:.3f}"
    console.print(line, style=None if e["speedup"] > 1 else "yellow", highlight=False)


def _memory_table(p: dict) -> None:
    table = Table(
        "",
        "plain",
        "with speculation",
        title=f"memory plan: {human(p['device_bytes'])} device, "
        f"{human(p['usable_bytes'])} usable, context {p['context']} × batch {p['batch']}, γ = {p['gamma']}",
    )
    table.add_row("weights", human(p["target_weight_bytes"]), human(p["target_weight_bytes"] + p["draft_weight_bytes"]))
    table.add_row(
        "KV / token", human(p["target_kv_per_token"]), human(p["target_kv_per_token"] + p["draft_kv_per_token"])
    )
    table.add_row("needed", human(p["need_plain"]), human(p["need_spec"]))
    table.add_row("fits", "yes" if p["fits_plain"] else "NO", "yes" if p["fits_spec"] else "NO")
    table.add_row(f"max context at batch {p['batch']}", str(p["max_context_plain"]), str(p["max_context_spec"]))
    table.add_row(f"max batch at context {p['context']}", str(p["max_batch_plain"]), str(p["max_batch_spec"]))
    out.print(table)
