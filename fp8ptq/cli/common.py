"""What every command shares: the consoles (the only place fp8ptq prints), progress bars, the one place
library errors become one-line CLI errors, gate output, and the shared eval options."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fp8ptq.errors import Fp8ptqError

console = Console(stderr=True)
out = Console()


def return_freed_memory(mib: int = 1) -> None:
    """Fix glibc's mmap threshold at `mib` MiB so freed calibration activations go back to the OS.

    glibc raises its mmap threshold after each large free (up to 32 MiB), after which activation chunks
    below it are carved from the heap and peak RSS ratchets up with fragmentation. A fixed threshold stops
    that (CLI process only; the library does not touch allocator settings). Every allocation above it is
    a fresh mmap whose pages the kernel faults in and zeroes on each use: at 1 MiB, runs whose steps
    allocate many 1-8 MiB tensors pay that on every op (SignRound 1.9x slower; BENCHMARKS.md), so the
    quantize command raises it for those (cli/quantize.mmap_threshold_mib). A threshold the user set
    (glibc's MALLOC_MMAP_THRESHOLD_ environment variable) is left as it is."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, mib << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass  # not glibc: nothing to tune


def offline() -> None:
    from fp8ptq.models.loader import ensure_offline

    ensure_offline()


@contextmanager
def progress_bar(enabled: bool):
    """A rich progress callback (stage, done, total) -> one bar per stage."""
    if not enabled:
        yield None
        return
    if not console.is_terminal:  # a log file or CI: plain lines, each stage every 30 s and when it ends
        import time

        last: dict[str, float] = {}
        t0 = time.perf_counter()

        def line(stage: str, done: int, total: int) -> None:
            now = time.perf_counter()
            if done >= total or now - last.setdefault(stage, t0) >= 30.0:
                last[stage] = now
                console.print(f"{stage}: {done}/{total} ({now - t0:.0f} s)", highlight=False)

        yield line
        return
    with Progress(
        TextColumn("{task.description:<10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        tasks: dict[str, int] = {}

        def update(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = bar.add_task(stage, total=total)
            bar.update(tasks[stage], completed=done, total=total)

        yield update


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """Text from untrusted input (a recipe's or a tensor's name inside a message) with terminal control
    characters shown as escapes: an ESC sequence in a name must not reach the user's terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def expand_home(path):
    """Option callback for paths fp8ptq writes: `~` means the home folder as it does for inputs (a quoted
    `-o '~/out'` reaches fp8ptq unexpanded by the shell)."""
    return None if path is None else type(path)(os.path.expanduser(str(path)))


def fail(err: Exception) -> None:
    console.print(f"[bold red]error:[/] {escape(printable(str(err)))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _resume_hint(output) -> str:
    """Where an interrupted quantize run kept its finished layers (export/rundir.py), if it did."""
    if output is None:
        return ""
    from pathlib import Path

    from fp8ptq.export.rundir import partial_path

    partial = partial_path(Path(output))
    return f"; the finished layers are kept in '{partial}': repeat with --resume to go on" if partial.is_dir() else ""


@contextmanager
def user_errors(output=None):
    """Library errors and failures of the machine (full disk, read-only or forbidden paths, busy files:
    io.environment_error) become one `error:` line and exit 2; anything else is a bug and keeps its
    traceback. `output`: the path the command writes, named when the failure carries none."""
    from fp8ptq.io import environment_error

    try:
        yield
    except Fp8ptqError as err:
        fail(err)
    except KeyboardInterrupt:
        console.print(
            "[red]interrupted: no complete output was written[/] (a quantize run keeps its finished "
            "layers hidden in .OUT.partial: repeat the command with --resume to continue)"
        )
        raise typer.Exit(code=130) from None
    except Exception as err:
        env = environment_error(err, output)
        if env is None:
            raise
        console.print(f"[bold red]error:[/] {env}{_resume_hint(output)}", highlight=False, soft_wrap=True)
        raise typer.Exit(code=2) from None


def check_save(save, inputs=()) -> None:
    """`--save FILE`, checked before any work: a file (not a folder) in a writable place, apart from
    every input."""
    if save is None:
        return
    from fp8ptq.errors import OutputError
    from fp8ptq.io import check_not_input, check_writable

    with user_errors(save):
        if save.is_dir():
            raise OutputError(f"--save '{save}' is a directory", fix=f"name a file, e.g. --save {save / 'result.json'}")
        if save.exists() and not save.is_file():  # a device or a pipe: the atomic rename would replace it
            raise OutputError(f"--save '{save}' is not a regular file", fix="name a file, e.g. --save result.json")
        check_not_input(save, inputs)
        check_writable(save.parent, "--save")


def write_save(save, result: dict, indent: int = 2) -> None:
    """Write `--save`'s JSON atomically (a full disk leaves the old file, and one error line)."""
    if save is None:
        return
    import json

    from fp8ptq.io import write_bytes_atomic

    with user_errors(save):
        save.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(save, (json.dumps(result, indent=indent) + "\n").encode())


def record_eval(model, name: str, result: dict):
    """Record an evaluation in an fp8ptq checkpoint's report (report.save_eval), one error line if the
    machine refuses the write."""
    from pathlib import Path

    from fp8ptq.report import save_eval

    with user_errors(model):
        return save_eval(Path(model), name, result)


GATE_FAILED_EXIT = 3
ENGINE_FAILED_EXIT = 4


def finish_gates(results: list[dict], quiet: bool = False) -> None:
    """Print gate results (quiet: --json, where they are in the JSON); exit GATE_FAILED_EXIT when any
    failed (after everything else was printed)."""
    from fp8ptq.gates import GateResult

    if not results:
        return
    failed = 0
    for r in results:
        res = GateResult.from_dict(r)
        if not quiet:
            console.print(
                ("[green]gate[/] " if r["passed"] else "[bold red]gate[/] ") + res.describe(), highlight=False
            )
        failed += not r["passed"]
    if failed:
        if not quiet:
            console.print(f"[bold red]{failed} of {len(results)} quality gates failed[/]")
        raise typer.Exit(code=GATE_FAILED_EXIT)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def quality_rows(table: Table, q) -> None:
    """The rows of a quality result (eval.quality.QualityMetrics, or the manifest's Quality)."""
    table.add_row("PPL (reference → quantized)", f"{q.ppl_reference:.3f} → {q.ppl:.3f}")
    table.add_row("KL(ref ‖ quant) / token", f"{q.kl:.5f}")
    table.add_row("top-1 agreement", f"{q.top1 * 100:.2f}%")
    table.add_row("eval tokens", str(q.tokens))


EVAL_OPTS = dict(  # the evaluation commands' own flags (their other options: eval/config.py's fields)
    json_out=typer.Option(False, "--json"),
    save=typer.Option(None, "--save", callback=expand_home, help="also write the result JSON to this file"),
    no_record=typer.Option(False, "--no-record", help="do not record the result in an fp8ptq checkpoint's report"),
)
