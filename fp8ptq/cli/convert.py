"""`fp8ptq convert`."""

from __future__ import annotations

import json

import typer

from fp8ptq.cli.app import app
from fp8ptq.cli.common import console, fail, offline, out, user_errors
from fp8ptq.cli.fielded import config_command
from fp8ptq.conversion.registry import ConvertConfig
from fp8ptq.errors import Fp8ptqError


@app.command()
@config_command(ConvertConfig)
def convert(
    cfg: ConvertConfig,
    json_out: bool = typer.Option(
        False, "--json", help="print the report (summary, every tensor's action) as JSON instead of the line"
    ),
):
    """Convert between GGUF and Hugging Face checkpoints: a GGUF to float (--to hf) or to
    compressed-tensors with Q4_0/Q8_0 Linears carried bit-exactly as INT4/INT8 group-32 weights
    (--to compressed-tensors, report in OUT/conversion.json); a transformers block-FP8 directory to
    compressed-tensors block FP8 with the same bytes, and GPTQ / AWQ / NVIDIA ModelOpt (FP8, NVFP4)
    directories to compressed-tensors with the same codes, scales and zero points (--to
    compressed-tensors; the format is detected, --from confirms it); a compressed-tensors
    checkpoint to GGUF with symmetric INT4/INT8 codes as Q4_0/Q8_0 (--to gguf), or any float or
    compressed-tensors checkpoint to a GGUF K-quant mix as llama.cpp defines it (--gguf-type Q4_K_M).

    \b
    Examples:
      fp8ptq convert model.Q4_0.gguf -o out/model-bf16
      fp8ptq convert model.Q4_0.gguf --to compressed-tensors -o out/model-w4a16
      fp8ptq convert model.Q4_K_M.gguf --to compressed-tensors --recipe fp8-dynamic -o out/model-fp8
      fp8ptq convert out/model-w4a16 --to gguf -o out/model.Q4_0.gguf
      fp8ptq convert ./SmolLM2-135M --to gguf --gguf-type Q4_K_M -o out/smol.Q4_K_M.gguf
      fp8ptq convert ./SmolLM2-135M --to gguf --gguf-type Q4_K_M --importance builtin -o out/s.gguf
      fp8ptq convert ./Qwen3-0.6B-FP8 --to compressed-tensors -o out/qwen3-fp8-block
      fp8ptq convert ./Llama-3.2-1B-GPTQ --from gptq --to compressed-tensors -o out/llama-w4a16
      fp8ptq convert ./model-AWQ --to compressed-tensors -o out/model-w4a16-asym
      fp8ptq convert ./model-modelopt-fp8 --from modelopt --to compressed-tensors -o out/model-fp8
      fp8ptq convert model.Q4_0.gguf --to compressed-tensors -o out/w4 --json > out/w4.report.json
    """
    offline()
    from fp8ptq.api import convert as run

    if cfg.dtype not in ("bfloat16", "float16", "float32"):
        fail(Fp8ptqError(f"unknown --dtype '{cfg.dtype}'", fix="use bfloat16, float16 or float32"))
    with user_errors(cfg.output):
        with console.status(f"converting {cfg.source}"):
            report = run(cfg)
    if json_out:
        from fp8ptq.results import to_json

        typer.echo(json.dumps(to_json(report), indent=2))
        return
    if report.line:
        out.print(report.line)
    out.print(f"wrote {report.output}")
