"""Atomic output directories: write into a hidden sibling temp dir, rename into place at the end.

An interrupted run leaves only `.NAME.partial-*`, never a directory that looks complete.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from fp8ptq.errors import OutputError


def check_output(out: Path, overwrite: bool) -> None:
    """Fail early (before any work) if `out` exists and may not be replaced."""
    if out.exists() and not overwrite:
        raise OutputError(f"output '{out}' already exists", fix="choose another -o path or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise OutputError(f"output '{out}' exists and is not a directory", fix="choose another -o path")


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False):
    """Yield a temp dir; on success it becomes `out` (replacing it if overwrite), on error it is removed."""
    out = Path(out)
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like any other dir
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
