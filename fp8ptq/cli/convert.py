"""`fp8ptq convert`."""

from __future__ import annotations

from pathlib import Path

import typer

from fp8ptq.cli.app import app
from fp8ptq.cli.common import console, fail, offline, out, user_errors
from fp8ptq.errors import Fp8ptqError


@app.command()
def convert(
    gguf: Path = typer.Argument(..., help=".gguf file"),
    output: Path = typer.Option(..., "--output", "-o"),
    dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32"),
    overwrite: bool = typer.Option(False),
):
    """Dequantize a GGUF file into a Hugging Face safetensors directory.

    \b
    Examples:
      fp8ptq convert model.Q4_0.gguf -o out/model-bf16
    """
    offline()
    from fp8ptq.api import ConvertConfig
    from fp8ptq.api import convert as run

    if dtype not in ("bfloat16", "float16", "float32"):
        fail(Fp8ptqError(f"unknown --dtype '{dtype}'", fix="use bfloat16, float16 or float32"))
    with user_errors():
        with console.status(f"converting {gguf}"):
            path = run(ConvertConfig(source=gguf, output=output, dtype=dtype, overwrite=overwrite))
    out.print(f"wrote {path}")
