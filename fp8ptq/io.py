"""The lowest floor: durable file writes, output directories that appear only when complete, the
safetensors dtype table, and giving freed heap memory back to the OS. Imports only fp8ptq.errors.

Every file fp8ptq writes that another run (or a resumed one) may read goes through `write_atomic`:
written to a hidden temp sibling, fsynced, then renamed over the target, so a reader sees the old
file or the whole new one, never a torn one, whatever kills the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import re
import shutil
import signal
import tempfile
import threading
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


def own_subdir(parent: Path, name: str) -> Path:
    """parent/name as a directory of parent's own: created when missing; a symlink (or a file) of that name,
    which fp8ptq never makes, is removed first, so that nothing written under it lands in another folder."""
    d = Path(parent) / name
    if d.is_symlink() or (d.exists() and not d.is_dir()):
        d.unlink()
    d.mkdir(exist_ok=True)
    return d


def write_bytes_atomic(path: Path, data: bytes) -> None:
    write_atomic(path, lambda tmp: tmp.write_bytes(data))


def write_json_atomic(path: Path, data, *, trailing_newline: bool = False) -> None:
    """JSON with indent 2, strict: NaN/inf raise ValueError instead of writing invalid JSON."""
    text = json.dumps(data, indent=2, allow_nan=False) + ("\n" if trailing_newline else "")
    write_bytes_atomic(path, text.encode())


# Written into every directory fp8ptq creates through atomic_output_dir; a quantized checkpoint is
# recognised by its fp8ptq_manifest.json instead (its files stay as they were). --overwrite replaces only
# a directory that carries one of the two: fp8ptq deletes nothing it did not write.
OUTPUT_MARKER = ".fp8ptq-output"
OWN_FILES = (OUTPUT_MARKER, "fp8ptq_manifest.json")


def written_by_fp8ptq(path: Path) -> bool:
    return Path(path).is_dir() and any((Path(path) / f).is_file() for f in OWN_FILES)


def path_identity(path: Path) -> tuple[int, int] | None:
    """(device, inode) of what is at `path` now (a symlink itself, not its target), None if nothing."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _run_in_progress(path: Path) -> bool:
    """fp8ptq's own unfinished run directory (export/rundir.py: `.NAME.partial` holding state.json): a
    quantize run writes its draft bundle into it, the draft reading the target beside it."""
    return path.name.startswith(".") and path.name.endswith(".partial") and (path / "state.json").is_file()


def check_not_input(out: Path, inputs=()) -> None:
    """OutputError unless `out` is apart from every input: not the input, not inside it, not a folder
    that holds it. Inputs that are not local paths (aliases, hub ids) are skipped."""
    target = Path(out).expanduser().resolve()
    for given in inputs:
        if given is None or str(given) == "":
            continue
        p = Path(str(given)).expanduser()
        if not p.exists():
            continue
        src = p.resolve()
        if target == src:
            raise OutputError(f"output '{out}' is the input '{given}'", fix="choose an -o path apart from the input")
        if src in target.parents and not _run_in_progress(src):
            raise OutputError(
                f"output '{out}' lies inside the input '{given}'", fix="choose an -o path outside the input folder"
            )
        if target in src.parents:
            raise OutputError(
                f"output '{out}' holds the input '{given}': writing it would replace the input",
                fix="choose an -o path that does not contain the input",
            )


def check_output(out: Path, overwrite: bool, inputs=()) -> None:
    """Fail early (before any work) if `out` may not be written: it is (or holds, or is inside) one of
    `inputs`, or it exists and either --overwrite is not given or fp8ptq did not write it."""
    out = Path(out)
    check_not_input(out, inputs)
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise OutputError(f"output '{out}' already exists", fix="choose another -o path or pass --overwrite")
        if out.is_symlink() or not out.is_dir():
            raise OutputError(f"output '{out}' exists and is not a directory", fix="choose another -o path")
        if not written_by_fp8ptq(out):
            raise OutputError(
                f"--overwrite: '{out}' was not written by fp8ptq (it holds no {' or '.join(OWN_FILES)}), "
                "and fp8ptq replaces only folders it wrote",
                fix="delete it yourself if it may go, or choose another -o path",
            )
    check_writable(out.parent)


def replace_dir(tmp: Path, out: Path, approved: tuple[int, int] | None) -> None:
    """Rename the finished `tmp` onto `out`. `approved` is what was at `out` when the run started
    (check_output let it be replaced; None: nothing was there). Anything else found there now (a folder
    made during the run, or one swapped in) is left alone: OutputError, and `tmp` is kept for the user."""
    now = path_identity(out)
    if now is not None and (now != approved or not written_by_fp8ptq(out)):
        raise OutputError(
            f"'{out}' appeared or changed while this run was writing it; it was left as it is and the finished "
            f"result is in '{tmp}'",
            fix=f"move '{tmp}' where you want it (or remove '{out}' and rename it)",
        )
    old = None
    with _no_interrupt():  # Ctrl-C between the two renames would leave neither the old nor the new result
        if now is not None:
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
        os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _no_interrupt():
    """SIGINT/SIGTERM arriving during the block are held and delivered after it (main thread only; a
    no-op elsewhere). The Python-level handlers are swapped, not the thread's signal mask: the kernel may
    deliver a process signal to any thread, and CPython runs the handler in the main thread anyway."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    held = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if caught:
            signal.raise_signal(caught[0])  # now, to the handler that was there (Ctrl-C: KeyboardInterrupt)


# errno -> (what happened, the fix); {where} is the file or output the failure concerns.
_ENVIRONMENT = {
    errno.ENOSPC: ("no space left on the device", "free space where {where} lies, or write elsewhere"),
    errno.EDQUOT: ("disk quota exceeded", "free space in your quota, or write elsewhere"),
    errno.EROFS: ("read-only file system", "choose a path on a writable file system"),
    errno.EACCES: ("permission denied", "check the permissions of {where}, or choose a path you can write"),
    errno.EPERM: ("operation not permitted", "check the permissions of {where}, or choose another path"),
    errno.EBUSY: ("resource busy", "another program holds {where}: close it and retry"),
    errno.ETXTBSY: ("file busy", "another program holds {where}: close it and retry"),
    errno.EFBIG: ("file too large", "raise the file-size limit (ulimit -f) or write to a file system that allows it"),
    errno.EMFILE: ("too many open files", "raise the open-file limit (ulimit -n) and retry"),
    errno.ENFILE: ("too many open files in the system", "close other programs and retry"),
    errno.EIO: ("input/output error", "check the disk holding {where} (dmesg), then retry"),
    errno.ENOENT: ("no such file or directory", "check that {where} exists and was not moved during the run"),
    errno.ENOTDIR: ("not a directory", "check that the folders on the way to {where} are folders"),
    errno.EISDIR: ("is a directory", "name a file, not a folder, at {where}"),
    errno.ENAMETOOLONG: (
        "file name too long",
        "choose a shorter output name (fp8ptq adds hidden .NAME.partial siblings)",
    ),
}
_OS_ERROR_CODE = re.compile(r"os error (\d+)|\[Errno (\d+)\]")


def environment_error(exc: BaseException, where: Path | str | None = None) -> OutputError | None:
    """A one-line OutputError for a failure of the machine rather than of fp8ptq (full disk, read-only or
    forbidden path, busy file, file limits), found on `exc` or the exceptions it came from (safetensors'
    Rust writer reports it only in its message); None for anything else, which stays a bug."""
    if isinstance(exc, MemoryError):  # a tensor or a file declared larger than this machine holds
        return OutputError(
            f"out of memory while working on '{where or 'the model'}'",
            fix="check the model's tensor sizes (a corrupt header can declare any shape), or free memory",
        )
    seen = 0
    while exc is not None and seen < 8:
        code, path = None, None
        if isinstance(exc, OSError) and exc.errno in _ENVIRONMENT:
            code, path = exc.errno, exc.filename
        else:
            m = _OS_ERROR_CODE.search(str(exc))
            if m and int(m.group(1) or m.group(2)) in _ENVIRONMENT:
                code = int(m.group(1) or m.group(2))
        if code is not None:
            what, fix = _ENVIRONMENT[code]
            if path is not None and Path(str(path)).name.startswith("."):  # a temp file of write_atomic & co
                path = where or Path(str(path)).parent
            place = str(path or where or "the output")
            return OutputError(f"{what} while working on '{place}'", fix=fix.format(where=f"'{place}'"))
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def check_writable(directory: Path, flag: str = "-o") -> None:
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
            fix=f"choose a path for {flag} in a directory you can write",
        ) from None


@contextmanager
def atomic_output_dir(out: Path, overwrite: bool = False, inputs=()):
    """A non-resumable temp dir (small outputs: converted models, drafts): on success it becomes `out`
    (replacing it if overwrite and fp8ptq wrote it; see check_output, replace_dir), on error it is
    removed. The result carries OUTPUT_MARKER."""
    out = Path(out)
    check_output(out, overwrite, inputs)
    approved = path_identity(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the result should look like any other dir
    try:
        yield tmp
        (tmp / OUTPUT_MARKER).write_text("written by fp8ptq: `--overwrite` may replace this folder\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out, approved)


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


MAX_YAML_DEPTH = 32  # a recipe nests four levels deep


def load_yaml(text: str) -> object:
    """YAML as a recipe or `--set` value is read: safe (no tags that build objects), a key given twice is an
    error instead of silently the last one, and nesting deeper than MAX_YAML_DEPTH is refused before it
    recurses (a hostile file of nested brackets made PyYAML's constructor overflow the stack). Raises
    ValueError (or yaml.YAMLError) with what is wrong."""
    import yaml

    class Strict(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for k, _ in node.value:
                key = self.construct_object(k, deep=True)
                if not isinstance(key, (str, int, float, bool)) or key is None:
                    continue  # a mapping or list as a key: the validation after says what is wrong
                if key in seen:
                    raise ValueError(f"key '{key}' is given twice (line {k.start_mark.line + 1})")
                seen.add(key)
            return super().construct_mapping(node, deep)

    loader = Strict(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:  # the composer recurses once per level: an unclosed tower of brackets
            raise ValueError(f"nested more than {MAX_YAML_DEPTH} levels deep") from None
        stack = [(node, 1)] if node is not None else []
        while stack:
            n, depth = stack.pop()
            if depth > MAX_YAML_DEPTH:
                raise ValueError(f"nested more than {MAX_YAML_DEPTH} levels deep (line {n.start_mark.line + 1})")
            if isinstance(n.value, list):
                for child in n.value:
                    stack.extend((c, depth + 1) for c in (child if isinstance(child, tuple) else (child,)))
        return None if node is None else loader.construct_document(node)
    finally:
        loader.dispose()


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError in the block once `seconds` have passed (Python checks for signals between
    bytecodes and inside `re`'s backtracking): a bound on work that untrusted input drives (a recipe's
    regular expression, a checkpoint's chat template). Signals reach only the main thread: elsewhere the
    block runs unbounded. An earlier SIGALRM handler and timer are put back."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(*_):
        raise TimeoutError(f"over {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
