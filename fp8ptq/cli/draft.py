"""Draft commands: draft-train (distil a draft from the target's own generations) and draft-trim
(VocabTrim its LM head). Each builds one config object and calls one fp8ptq.spec function."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from fp8ptq.cli.app import app
from fp8ptq.cli.common import console, fail, offline, out, progress_bar, user_errors
from fp8ptq.cli.fielded import choice_command, config_command
from fp8ptq.draft.config import DraftTrainConfig, DraftTrimConfig, Eagle3TrainConfig
from fp8ptq.errors import Fp8ptqError, check_option


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def _training_rows(table: Table, meta, loss_name: str) -> None:
    """A trainer's summary (draft.loop.TrainSummary): steps, loss, time."""
    table.add_row("steps", f"{meta.steps} (stopped by {meta.stopped_by}; resumed from {meta.resumed_from})")
    if meta.loss_first is not None:
        table.add_row(loss_name, f"{meta.loss_first:.4f} → {meta.loss_last:.4f}")
    table.add_row("time", ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in meta.timings.items()))


@app.command("draft-train")
@choice_command(
    {"model": DraftTrainConfig, "eagle3": Eagle3TrainConfig},
    flag="--kind",
    default="model",
    help="model: a small draft LLM; eagle3: an EAGLE-3 head (vLLM method eagle3)",
)
def draft_train_cmd(cfg, json_out: bool = typer.Option(False, "--json", help="print the summary as JSON")):
    """Distil a small draft from the target on the target's own generations (shares its vocabulary).

    \b
    Examples:
      fp8ptq draft-train out/q -o out/draft --layers 2 --time-budget 900
      fp8ptq draft-train out/q -o out/draft --resume        # continue an interrupted run
      fp8ptq draft-train out/q -o out/eagle3 --kind eagle3 --draft-vocab 8192 --time-budget 900
    """
    offline()
    try:  # NaN fails every comparison, so it is refused here with the range, before any work
        check_option("--lr", cfg.lr, minimum=1e-9, maximum=1.0)
    except Fp8ptqError as err:
        fail(err)
    if isinstance(cfg, Eagle3TrainConfig):
        _eagle3_train(cfg, json_out=json_out)
    else:
        _draft_train(cfg, json_out=json_out)


def _eagle3_train(cfg: Eagle3TrainConfig, *, json_out: bool) -> None:
    from fp8ptq.draft.eagle3_train import eagle3_train

    output = cfg.output
    with user_errors(output), progress_bar(not json_out) as progress:
        meta = eagle3_train(cfg, progress)
    if json_out:
        _echo_json(meta.file_json())
        return
    table = Table(title=f"fp8ptq draft-train --kind eagle3 → {output}", show_header=False)
    table.add_row("target", meta.target)
    table.add_row("head", f"EAGLE-3, aux layers {meta.layer_ids}, draft vocabulary {meta.draft_vocab}")
    table.add_row("kept-vocabulary coverage", f"{meta.kept_coverage_of_generated_tokens:.2%} of generated tokens")
    table.add_row("data", f"{meta.data.sequences} sequences, {meta.data.tokens} tokens")
    _training_rows(table, meta, "TTT KL loss")
    out.print(table)
    console.print(f"vLLM: speculative_config={{'method': 'eagle3', 'model': '{output}', ...}}", highlight=False)


def _draft_train(cfg: DraftTrainConfig, *, json_out: bool) -> None:
    from fp8ptq.draft.train import draft_train

    output = cfg.output
    with user_errors(output), progress_bar(not json_out) as progress:
        meta = draft_train(cfg, progress)
    if json_out:
        _echo_json(meta.file_json())
        return
    table = Table(title=f"fp8ptq draft-train → {output}", show_header=False)
    table.add_row("target", meta.target)
    table.add_row("draft", meta.init)
    table.add_row("data", f"{meta.data.samples} generations, {meta.data.generated_tokens} target tokens")
    _training_rows(table, meta, "KL loss")
    out.print(table)


@app.command("draft-trim")
@config_command(DraftTrimConfig)
def draft_trim_cmd(cfg: DraftTrimConfig, json_out: bool = typer.Option(False, "--json")):
    """VocabTrim: keep the N most frequent target-generated tokens in the draft's LM head.

    \b
    Examples:
      fp8ptq draft-trim out/draft --target out/q --keep 8192 -o out/draft-trim
    """
    offline()
    from fp8ptq.draft.trim import draft_trim
    from fp8ptq.results import to_json

    output = cfg.output
    with user_errors(output), progress_bar(not json_out) as progress:
        s = draft_trim(cfg, progress)
    if json_out:
        _echo_json(to_json(s))
        return
    table = Table(title=f"fp8ptq draft-trim → {output}", show_header=False)
    table.add_row("kept", f"{s.keep} of {s.vocab} ids ({s.special_kept} special)")
    table.add_row("frequencies from", f"{s.frequency_source}, {s.counted_tokens} tokens")
    held = s.coverage_heldout
    table.add_row(
        "coverage (counted / held out)",
        f"{s.coverage_counted:.2%} / " + (f"{held:.2%}" if held is not None else "–"),
    )
    table.add_row("LM-head FLOPs saved", f"{s.lm_head_flops_saving:.1%}")
    table.add_row("SGLang token map", str(output / "token_map.pt"))
    out.print(table)
    console.print("measure its acceptance: fp8ptq spec measure TARGET " + str(output), highlight=False)
