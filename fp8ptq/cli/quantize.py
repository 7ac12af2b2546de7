"""`fp8ptq quantize`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from fp8ptq.cli.app import app
from fp8ptq.cli.common import (
    GATE_HELP,
    console,
    finish_gates,
    human,
    is_rank0,
    offline,
    out,
    progress_bar,
    quality_rows,
    return_freed_memory,
    user_errors,
)
from fp8ptq.draft.auto import DRAFT_TIME_BUDGET_S


@app.command()
def quantize(
    model: str = typer.Argument(..., help="HF model dir, hub id (org/name), .gguf file, or alias (smollm2-135m)"),
    recipe: str = typer.Option("fp8-kv8", "--recipe", "-r", help="built-in recipe name or YAML path"),
    revision: Optional[str] = typer.Option(None, help="hub ids: branch, tag or commit (default: main)"),
    output: Path = typer.Option(..., "--output", "-o", help="output directory (written atomically)"),
    data: List[str] = typer.Option(
        ["builtin"],
        help="calibration text: builtin, .txt, .jsonl, .parquet or a datasets folder; PATH:WEIGHT, repeated: a mix",
    ),
    text_field: str = typer.Option("text", help="field holding the text in .jsonl/.parquet/datasets"),
    images: Optional[str] = typer.Option(
        None,
        help='multimodal checkpoints: a .jsonl of {"image": PATH, "text": TEXT}, each line one image+text '
        "calibration sample in place of a text sample",
    ),
    num_samples: Optional[int] = typer.Option(None, help="calibration samples (default: the recipe's)"),
    seq_len: Optional[int] = typer.Option(None, help="tokens per calibration sample (default: the recipe's)"),
    seed: Optional[int] = typer.Option(None, help="sample-selection seed (default: the recipe's)"),
    chat_template: bool = typer.Option(False, help="wrap each calibration text in the tokenizer's chat template"),
    eval_samples: int = typer.Option(8, help="held-out samples for the quality check (0 = skip)"),
    gate: List[str] = typer.Option([], "--gate", help=GATE_HELP),
    no_recipe_gates: bool = typer.Option(False, "--no-recipe-gates", help="ignore the gates the recipe carries"),
    overwrite: bool = typer.Option(False, help="replace an existing output directory (or discard an interrupted run)"),
    resume: bool = typer.Option(False, help="continue an interrupted run of the same command from its last checkpoint"),
    device: str = typer.Option(
        "auto", help="auto (CUDA when present), cpu, cuda or cuda:N (one layer at a time is moved there)"
    ),
    compute_dtype: str = typer.Option(
        "auto",
        help="arithmetic of the calibration passes: auto (tf32 on CUDA, fp32 on a CPU), fp32, tf32 (CUDA) or "
        "bf16; Hessians and GPTQ stay fp32",
    ),
    chunk_tokens: int = typer.Option(
        8192, help="calibration tokens per step: bounds activation memory, not the result"
    ),
    offload_activations: bool = typer.Option(False, help="keep calibration activations on disk (RAM: one chunk)"),
    int4_fraction: Optional[float] = typer.Option(None, help="mixed recipes: share of linear FLOPs at 4 bit"),
    tp: Optional[int] = typer.Option(None, help="flatten recipes: tensor-parallel size the MLP width must divide"),
    group_size: Optional[int] = typer.Option(
        None, help="group-weight recipes (w4a16, w4a8-fp8): input channels per weight scale"
    ),
    block_size: Optional[int] = typer.Option(
        None, help="block recipes: B of the [B, B] weight blocks and input groups (must divide every width)"
    ),
    weights: Optional[str] = typer.Option(
        None, help="rtn (round to nearest: fastest) or gptq: override the recipe's weight rounding"
    ),
    smooth_alpha: Optional[str] = typer.Option(
        None,
        help="SmoothQuant recipes (w8a8-int8, nvfp4, flatten-w8a8): 'auto' (measured per layer) or one "
        "alpha in [0, 1] for every layer: no search, a faster calibration",
    ),
    set_: list[str] = typer.Option(
        [],
        "--set",
        metavar="KEY=VALUE",
        help="change any recipe key, repeatable: --set calibration.gptq_damp=0.05 (VALUE is YAML; the flags "
        "above are aliases with their own checks; keys: fp8ptq recipes show NAME)",
    ),
    rotate: bool = typer.Option(
        False, "--rotate", help="add the recipe transform 'rotate': Hadamard rotations folded into the float model"
    ),
    quantize_lm_head: bool = typer.Option(
        False,
        "--quantize-lm-head",
        help="quantize the LM head too (the recipe's weights per channel, dynamic inputs; a tied head is untied)",
    ),
    draft: str = typer.Option(
        "none",
        help="auto: also distil a draft from the quantized model (eagle3: train an EAGLE-3 head for it), "
        "measure it and write speculative_config.json + sglang_flags.txt beside it",
    ),
    draft_trim: Optional[int] = typer.Option(
        None, help="with --draft auto: also a VocabTrim draft keeping N tokens; eagle3: the head's draft vocabulary"
    ),
    draft_steps: Optional[int] = typer.Option(
        None, help="with --draft: training steps at most (default: draft-train's, 400; eagle3 2000)"
    ),
    draft_time_budget: Optional[float] = typer.Option(
        DRAFT_TIME_BUDGET_S, help="with --draft auto: training seconds at most"
    ),
    json_out: bool = typer.Option(False, "--json", help="print the manifest as JSON on stdout"),
):
    """Calibrate, quantize and export a compressed-tensors checkpoint.

    MODEL is a Hugging Face directory, a hub id (downloaded, or read from the local Hugging Face cache
    when offline: HF_HUB_OFFLINE=1), a .gguf file or an alias (smollm2-135m). The output directory
    appears only when complete. Under `torchrun --nproc-per-node N -m fp8ptq quantize ...` the
    calibration samples are split over N processes and the result equals a one-process run.

    \b
    Examples:
      fp8ptq quantize smollm2-135m -r fp8-kv8 -o out/smol-fp8-kv8
      fp8ptq quantize ./my-model -r w4a16 -o out/w4a16 --device cuda
      fp8ptq quantize Qwen/Qwen3-30B-A3B -r fp8-kv8 -o out/qwen3-moe-fp8   # hub id
      fp8ptq quantize ./my-model -r fp8-dynamic -o out/fp8   # data-free, no calibration
      fp8ptq quantize smollm2-135m -r fp8-block --block-size 64 -o out/smol-fp8-block
      fp8ptq quantize ./my-model -r fp8-kv8 -o out/q --weights rtn   # RTN instead of GPTQ
      fp8ptq quantize smollm2-135m -r w8a8-int8 --rotate -o out/int8-rot  # rotated
      fp8ptq quantize ./my-model -r nvfp4 --smooth-alpha 0.8 -o out/nvfp4  # no alpha search
      fp8ptq quantize ./my-model -r w4a16 --set calibration.gptq_damp=0.05 -o out/w4
      fp8ptq quantize smollm2-135m -r fp8-kv8 --quantize-lm-head -o out/q  # LM head too
      fp8ptq quantize ./smolvlm -r w8a8-int8 --images cal.jsonl -o out/vlm  # image+text
      fp8ptq recipes list                                    # what each recipe does
    """
    offline()
    return_freed_memory()
    from fp8ptq.api import QuantizeConfig, describe_device
    from fp8ptq.api import quantize as run
    from fp8ptq.runs.config import draft_bundle

    with user_errors(output):
        draft_settings = draft_bundle(draft, trim=draft_trim, steps=draft_steps, time_budget_s=draft_time_budget)
    cfg = QuantizeConfig(
        model=model,
        revision=revision,
        recipe=recipe,
        output=output,
        data=",".join(data),
        text_field=text_field,
        images=images,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        chat_template=chat_template,
        overwrite=overwrite,
        eval_samples=eval_samples,
        gates=tuple(gate),
        recipe_gates=not no_recipe_gates,
        resume=resume,
        device=device,
        compute_dtype=compute_dtype,
        chunk_tokens=chunk_tokens,
        offload_activations=offload_activations,
        int4_fraction=int4_fraction,
        tp=tp,
        block_size=block_size,
        group_size=group_size,
        weights=weights,
        smooth_alpha=smooth_alpha,
        sets=tuple(set_),
        rotate=rotate,
        quantize_lm_head=quantize_lm_head,
        draft=draft_settings,
    )
    with user_errors(output), progress_bar(not json_out and is_rank0()) as progress:
        manifest = run(cfg, progress)
    if manifest is None:  # a non-zero rank of a torchrun job: rank 0 reports
        return
    gates = [g.model_dump() for g in manifest.gates]
    if json_out:
        typer.echo(json.dumps(manifest.as_json(), indent=2))
        finish_gates(gates)
        return
    s = manifest.summary
    table = Table(title=f"fp8ptq quantize → {output}", show_header=False)
    table.add_row("model", manifest.model)
    table.add_row("recipe", manifest.recipe["name"])
    if manifest.recipe.get("transforms"):
        table.add_row("transforms", ", ".join(manifest.recipe["transforms"]))
    where = describe_device(device).removeprefix("device: ")
    if manifest.run.compute_dtype is not None:
        where += f", {manifest.run.compute_dtype} passes"
    table.add_row("device", where)
    table.add_row("decoder layers", str(s.layers))
    table.add_row("linears quantized", str(s.linears_quantized))
    table.add_row("linears skipped", ", ".join(f"{n} ({why})" for n, why in s.linears_skipped.items()) or "none")
    head = manifest.lm_head
    ignored = [p for p in manifest.recipe["scheme"]["ignore"] if not (head is not None and p == "lm_head")]
    table.add_row("ignored (recipe)", ", ".join(ignored) or "none")
    if head is not None:
        tied = ", untied from the embedding" if head.tied else ""
        table.add_row("LM head", f"quantized (rel. error {head.weight_rel_err:.4f}{tied})")
    table.add_row("worst linear rel. error", f"{s.worst_linear_rel_err:.4f}")
    sz = manifest.size_bytes
    table.add_row("size", f"{human(sz.source)} → {human(sz.output)} ({sz.ratio:.2f}×)")
    if manifest.quality is not None:
        quality_rows(table, manifest.quality)
    if manifest.mixed is not None:
        table.add_row("4-bit share of linear FLOPs", f"{manifest.mixed.int4_flop_share * 100:.1f}%")
    if manifest.speculative is not None:
        r = manifest.speculative.recommendation
        table.add_row(
            "speculative decoding",
            f"draft in {output / 'draft'}: γ={r.gamma}, τ={r.tau:.2f}, "
            f"c={r.c:.3f}, predicted {r.speedup:.2f}× (speculative_config.json)",
        )
    table.add_row("time", ", ".join(f"{k[:-2]} {v:.1f}s" for k, v in manifest.timings.items()))
    table.add_row("report", str(output / "report.html"))
    out.print(table)
    if manifest.gates_skipped:
        console.print(f"[yellow]recipe gates not checked (--eval-samples 0):[/] {', '.join(manifest.gates_skipped)}")
    finish_gates(gates)


@app.command("model-free")
def model_free_cmd(
    model: Path = typer.Argument(
        ..., help="a safetensors model directory (any architecture, even one transformers lacks)"
    ),
    output: Path = typer.Option(..., "--output", "-o", help="output directory (written atomically)"),
    recipe: str = typer.Option("fp8-dynamic", "--recipe", "-r", help="a data-free recipe: fp8-dynamic, fp8-block"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="list what would be quantized and kept, and why; write nothing"
    ),
    overwrite: bool = typer.Option(False, help="replace OUTPUT if fp8ptq wrote it"),
    json_out: bool = typer.Option(False, "--json"),
):
    """Quantize any safetensors checkpoint by tensor names and shapes, without building the model and
    without data: 2-D floating `*.weight` tensors are Linears, except embeddings, the LM head, MoE routers
    and vision/audio towers (kept, and listed in `ignore`); a tensor no rule places is refused by name.

    \b
    Examples:
      fp8ptq model-free ./my-new-arch --dry-run
      fp8ptq model-free ./my-new-arch -r fp8-dynamic -o out/my-new-arch-fp8
    """
    from fp8ptq.runs.model_free import ModelFreeConfig, model_free

    cfg = ModelFreeConfig(model=model, output=output, recipe=recipe, overwrite=overwrite, dry_run=dry_run)
    with user_errors(output), progress_bar(not json_out and not dry_run) as progress:
        summary = model_free(cfg, progress)
    if json_out:
        typer.echo(json.dumps(summary, indent=2))
        return
    table = Table(
        "decision", "tensors", "examples", title=f"fp8ptq model-free {'(dry run) ' if dry_run else ''}→ {output}"
    )
    for why, names in summary["by_reason"].items():
        table.add_row(why, str(len(names)), ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    out.print(table)
    console.print(f"ignore (kept Linears): {', '.join(summary['ignore']) or 'none'}", highlight=False)
