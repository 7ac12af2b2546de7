"""`fp8ptq quantize`."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Optional

import typer
from rich.table import Table

from fp8ptq.cli.app import app
from fp8ptq.cli.common import (
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
from fp8ptq.cli.fielded import config_command, field_option
from fp8ptq.draft.auto import DraftBundleConfig as D
from fp8ptq.runs.config import ModelFreeConfig
from fp8ptq.runs.config import QuantizeConfig as Q


@app.command()
@config_command(Q, exclude=("draft",))
def quantize(
    cfg: Q,
    draft: str = field_option(Q, "draft", default="none"),
    draft_trim: Optional[int] = field_option(D, "trim_keep", "--draft-trim"),
    draft_steps: Optional[int] = field_option(D, "max_steps", "--draft-steps"),
    draft_time_budget: Optional[float] = field_option(D, "time_budget_s", "--draft-time-budget"),
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
    from fp8ptq.api import describe_device
    from fp8ptq.api import quantize as run
    from fp8ptq.runs.config import draft_bundle

    output = cfg.output
    with user_errors(output):
        draft_settings = draft_bundle(draft, trim=draft_trim, steps=draft_steps, time_budget_s=draft_time_budget)
    cfg = replace(cfg, draft=draft_settings)
    return_freed_memory(mmap_threshold_mib(cfg))
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
    where = describe_device(cfg.device).removeprefix("device: ")
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
    kept = sorted(r["rounding_loss_kept_ratio"] for layer in manifest.layers for r in layer.get("rounding", []))
    if kept:  # calibration.rounding: signround (calibrate/signround.py)
        table.add_row(
            "SignRound", f"block output error {kept[len(kept) // 2]:.2f}× the solver's (median, {len(kept)} blocks)"
        )
    sz = manifest.size_bytes
    bits = "" if sz.weight_bits is None else f", {sz.weight_bits:.2f} bits per quantized weight"
    table.add_row("size", f"{human(sz.source)} → {human(sz.output)} ({sz.ratio:.2f}×{bits})")
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
@config_command(ModelFreeConfig)
def model_free_cmd(cfg: ModelFreeConfig, json_out: bool = typer.Option(False, "--json")):
    """Quantize any safetensors checkpoint by tensor names and shapes, without building the model and
    without data: 2-D floating `*.weight` tensors are Linears, except embeddings, the LM head, MoE routers
    and vision/audio towers (kept, and listed in `ignore`); a tensor no rule places is refused by name.

    \b
    Examples:
      fp8ptq model-free ./my-new-arch --dry-run
      fp8ptq model-free ./my-new-arch -r fp8-dynamic -o out/my-new-arch-fp8
    """
    from fp8ptq.runs.model_free import model_free

    output, dry_run = cfg.output, cfg.dry_run
    with user_errors(output), progress_bar(not json_out and not dry_run) as progress:
        summary = model_free(cfg, progress)
    if json_out:
        typer.echo(json.dumps(summary.as_dict(), indent=2))
        return
    table = Table(
        "decision", "tensors", "examples", title=f"fp8ptq model-free {'(dry run) ' if dry_run else ''}→ {output}"
    )
    for why, names in summary.by_reason.items():
        table.add_row(why, str(len(names)), ", ".join(names[:3]) + (", ..." if len(names) > 3 else ""))
    out.print(table)
    console.print(f"ignore (kept Linears): {', '.join(summary.ignore) or 'none'}", highlight=False)


def mmap_threshold_mib(cfg: Q) -> int:
    """The run's glibc mmap threshold (cli/common.return_freed_memory): 1 MiB, so freed activations go back
    to the OS (the default command's peak RSS: 974 MiB, 1225 at 8 MiB), except where the recipe trains
    its rounding (SignRound) without --offload-activations: its steps allocate and free 1-8 MiB tensors
    hundreds of times a layer, and at 8 MiB they come from the heap (1.9x faster on SmolLM2,
    BENCHMARKS.md). A recipe that does not load gets 1 MiB: the run reports its error."""
    from fp8ptq.errors import Fp8ptqError
    from fp8ptq.recipe import load_recipe
    from fp8ptq.runs.overrides import recipe_overrides

    try:
        recipe = recipe_overrides(cfg, load_recipe(cfg.recipe))
    except (Fp8ptqError, OSError, ValueError):
        return 1
    return 8 if recipe.calibration.rounding == "signround" and not cfg.offload_activations else 1
