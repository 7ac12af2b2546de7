"""fp8ptq command line (typer + rich). The only package that prints; each command builds one config
object, calls one library function with keywords, renders the result, and exits non-zero on any
failure (2: bad input, 3: a quality gate failed, 4: the engine could not run the checkpoint).

Layout: `app` (the typer app and sub-apps), `common` (consoles, progress, errors, gates), and one
module per command group; importing this package registers every command, in `--help` order. Heavy
imports (torch, transformers) happen inside the commands, so `fp8ptq --help` stays fast.
"""

# The order of registration is the order `fp8ptq --help` lists the commands.
# isort: off
from fp8ptq.cli import quantize  # noqa: F401
from fp8ptq.cli import convert  # noqa: F401
from fp8ptq.cli import inspect  # noqa: F401
from fp8ptq.cli import eval  # noqa: F401
from fp8ptq.cli import misc  # noqa: F401
from fp8ptq.cli import draft  # noqa: F401
from fp8ptq.cli import spec  # noqa: F401
from fp8ptq.cli import spec_compare  # noqa: F401
from fp8ptq.cli.app import app
# isort: on

__all__ = ["app"]
