"""`fp8ptq inspect`."""

from __future__ import annotations

import json

import typer

from fp8ptq.api import InspectConfig
from fp8ptq.cli.app import app
from fp8ptq.cli.common import offline, out, user_errors
from fp8ptq.cli.fielded import config_command


@app.command()
@config_command(InspectConfig)
def inspect(cfg: InspectConfig, json_out: bool = typer.Option(False, "--json", help="print the whole report as JSON")):
    """Say what a checkpoint is (format, schemes, size) and lint what would make vLLM refuse or
    mis-load it; one line per finding, exit 1 when any finding is an error.

    \b
    Examples:
      fp8ptq inspect out/smol-w4a16
      fp8ptq inspect model.Q4_0.gguf --json
      fp8ptq inspect out/smol-fp8-kv8 --engine sglang
    """
    offline()
    from fp8ptq.api import inspect as run

    with user_errors():
        report = run(cfg)
    if json_out:
        from fp8ptq.results import to_json

        typer.echo(json.dumps(to_json(report), indent=2))
    else:
        bits = f"{report.bits_per_param:.2f} bits/param, {report.size_bytes / 2**20:.1f} MiB"
        out.print(f"{report.path}: {report.format}, {bits}", highlight=False)
        for label, n in report.schemes.items():
            out.print(f"  {n} Linears {label}", highlight=False)
        if report.linears_unquantized is not None:
            out.print(f"  {report.linears_unquantized} Linears unquantized", highlight=False)
        for kind, n in report.tensor_types.items():
            out.print(f"  {n} tensors {kind}", highlight=False)
        for f in report.findings:
            out.print(
                f"{f.level}: {f.where}: {f.message} [{f.code}]",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
    if report.errors:
        raise typer.Exit(1)
