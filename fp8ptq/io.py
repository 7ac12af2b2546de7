"""The lowest floor: durable file writes, output directories that appear only when complete, the
safetensors dtype table, and giving freed heap memory back to the OS. Imports only fp8ptq.errors.

Every file fp8ptq writes that another run (or a resumed one) may read goes through `write_atomic`:
written to a hidden temp sibling, fsynced, then renamed over the target, so a reader sees the old
file or the whole new one, never a torn one, whatever kills the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from fp8ptq.errors import OutputError

# safetensors header dtype -> torch dtype (what fp8ptq reads and writes)
ST_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def write_atomic(path: Path, write: Callable[[Path], None]) -> None:
    """write(tmp) fills a temp file beside `path`; it is fsynced and renamed onto `path`.
    On any error the temp file is removed and `path` is untouched."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o666 & ~umask)  # mkstemp makes it private; the result should look like any other file
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_json_atomic(path: Path, data, *, trailing_newline: bool = False) -> None:
    """JSON with indent 2, strict: NaN/inf raise ValueError instead of writing invalid JSON."""
    text = json.dumps(data, indent=2, allow_nan=False) + ("\n" if trailing_newline else "")
    write_bytes_atomic(path, text.encode())


def check_output(out: Path, overwrite: bool) -> None:
    """Fail early (before any work) if `out` exists and may not be replaced."""
    if out.exists() and not overwrite:
        raise OutputError(f"output '{out}' already exists", fix="choose another -o path or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise OutputError(f"output '{out}' exists and is not a directory", fix="choose another -o path")
    check_writable(Path(out).parent)


def check_writable(directory: Path) -> None:
    """Fail early unless files can be created in `directory` (or in the nearest existing ancestor it
    would be created under): a probe file is made and removed, so root, ACLs and read-only or pseudo
    file systems (/proc) all answer truthfully."""
    probe = Path(directory).absolute()
    while not probe.exists():
        probe = probe.parent
    try:
        if not probe.is_dir():
            raise NotADirectoryError(str(probe))
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        why = "permission denied" if isinstance(err, PermissionError) else (err.strerror or type(err).__name__)
        raise OutputError(
            f"cannot write under '{directory}' ({why} at '{probe}')",
            fix="choose an -o path in a directory you can write",
        ) from None


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False):
    """A non-resumable temp dir (small outputs: converted models, drafts): on success it becomes `out`
    (replacing it if overwrite), on error it is removed."""
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


_LIBC = None


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    Streaming code frees one layer's tensors and allocates the next layer's of the same sizes. glibc
    raises its mmap threshold each time a large block is freed, so later tensors come from the heap,
    whose freed holes stay resident: the evaluator's RSS grew by one layer per layer (SmolLM2: 566 ->
    1348 MiB over 30 layers) although nothing held them. Called after each layer is released: flat in
    depth (556-746 MiB), a few milliseconds per call."""
    global _LIBC
    if _LIBC is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC = lib if hasattr(lib, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)
