"""Atomic, resumable output directories.

Everything is written into a hidden sibling `.NAME.partial` and renamed into place at the very end, so
a run killed at any point (SIGKILL included) never leaves a directory that looks complete. The partial
directory is also the resume point: it holds the finished layers, a `state.json` (what was done, and a
fingerprint of the inputs that produced it) and activation checkpoints. A lock file stops two runs from
writing the same output.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from fp8ptq.errors import Fp8ptqError, OutputError
from fp8ptq.io import check_output, path_identity, replace_dir, write_json_atomic

STATE = "state.json"
# fingerprint keys (runs/context.py) as a refusal names them
WHAT = {"model_content": "model weights (same sizes, files rewritten)", "model_bytes": "model size"}


def partial_path(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def _fresh_dir(path: Path) -> None:
    path.mkdir(parents=True)
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)


def acquire_lock(out: Path):
    """The open, exclusively locked `.NAME.lock` beside `out` (a one-line OutputError when another fp8ptq
    run holds it: no waiting). Give it back with release_lock."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f".{out.name}.lock"
    for _ in range(3):
        lock = open(path, "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise OutputError(
                f"another fp8ptq run is writing '{out}'", fix="wait for it, or choose another -o path"
            ) from None
        # the holder unlinks the file before it unlocks: a lock taken on a file no longer at `path` (its
        # holder finished between our open and our flock) guards nothing, so open the new one instead
        try:
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                return lock
        except FileNotFoundError:
            pass
        lock.close()
    raise OutputError(f"the lock beside '{out}' keeps changing hands", fix="retry when the other runs are done")


def release_lock(lock) -> None:
    """Unlink the lock file, then unlock it: a run that opened the file meanwhile finds it gone once it has
    the lock (acquire_lock checks) and takes the new one, so two runs never both hold a lock on `out`."""
    Path(lock.name).unlink(missing_ok=True)
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()


@contextmanager
def output_lock(out: Path):
    """Hold the lock on writing `out` for the block (runs that keep their own work directory beside
    the output, like draft training's, so two of them cannot share it)."""
    lock = acquire_lock(Path(out))
    try:
        yield
    finally:
        release_lock(lock)


class RunDir:
    """The hidden work directory of one run. Use as a context manager; `commit()` renames it to `out`."""

    def __init__(
        self,
        out: Path,
        *,
        overwrite: bool = False,
        resume: bool = False,
        fingerprint: dict | None = None,
        inputs=(),
    ):
        self.out, self.path = Path(out), partial_path(Path(out))
        self.overwrite, self.resume, self.fingerprint = overwrite, resume, fingerprint or {}
        self.inputs = tuple(inputs)
        self.approved = None  # what was at `out` when the run started (replace_dir)
        self.state: dict = {}
        self.resumed = False
        self.kept = False  # the finished result stays in `path`: the final rename was refused
        self._lock = None

    def __enter__(self) -> RunDir:
        check_output(self.out, self.overwrite, self.inputs)
        self.approved = path_identity(self.out)
        self._lock = acquire_lock(self.out)
        try:
            self._open()
        except BaseException:
            self._release()
            raise
        return self

    def _open(self) -> None:
        state_file = self.path / STATE
        if self.path.exists():
            state = {} if self.overwrite and not self.resume else self._read_state(state_file)
            if self.resume and state:
                diff = sorted(
                    k
                    for k in set(state.get("fingerprint", {})) | set(self.fingerprint)
                    if state.get("fingerprint", {}).get(k) != self.fingerprint.get(k)
                )
                if diff:
                    names = [WHAT.get(k, k) for k in diff]
                    raise OutputError(
                        f"cannot resume '{self.out}': the interrupted run used different {', '.join(names)}",
                        fix="repeat the original command with --resume, or pass --overwrite to start over",
                    )
                self.state, self.resumed = state, True
                return
            if not self.resume and not self.overwrite:
                done = state.get("layers_done", 0)
                raise OutputError(
                    f"an interrupted run left '{self.path}' ({done} layers done)",
                    fix="pass --resume to continue it, or --overwrite to start over",
                )
            shutil.rmtree(self.path)
        _fresh_dir(self.path)
        self.state = {"fingerprint": self.fingerprint}
        self.save_state()

    def _read_state(self, state_file: Path) -> dict:
        """The interrupted run's state.json ({} when there is none), or a one-line refusal when it is
        corrupt or of another shape (a crash mid-write cannot tear it: write_json_atomic)."""
        if not state_file.is_file():
            return {}
        try:
            state = json.loads(state_file.read_text())
            if not isinstance(state, dict) or not isinstance(state.get("fingerprint", {}), dict):
                raise ValueError("not an fp8ptq run state")
            if not isinstance(state.get("layers_done", 0), int) or not isinstance(state.get("checkpoint", 0), int):
                raise ValueError("layers_done / checkpoint are not integers")
        except (OSError, ValueError) as err:
            raise OutputError(
                f"cannot resume '{self.out}': its run state '{state_file}' is unreadable ({err})",
                fix="pass --overwrite to start over",
            ) from None
        return state

    def save_state(self, **updates) -> None:
        self.state.update(updates)
        write_json_atomic(self.path / STATE, self.state)

    def commit(self) -> None:
        """Rename the finished directory into place (replacing `out` when overwriting what was there at the
        start and fp8ptq wrote; anything else there now is left alone: io.replace_dir)."""
        (self.path / STATE).unlink(missing_ok=True)
        try:
            replace_dir(self.path, self.out, self.approved)
        except OutputError:
            self.kept = True  # its message sends the user to `path`: it must still be there
            raise

    def _release(self) -> None:
        if self._lock is not None:
            release_lock(self._lock)
            self._lock = None

    def __exit__(self, exc_type, exc, tb) -> None:
        # On a crash the partial directory is kept for --resume only if it holds finished layers;
        # otherwise there is nothing worth keeping. A typed input error (bad weights, bad data) is not
        # something --resume can fix: nothing is kept then.
        bad_input = exc_type is not None and issubclass(exc_type, Fp8ptqError)
        if exc_type is not None and not self.kept and (bad_input or not self.state.get("layers_done")):
            shutil.rmtree(self.path, ignore_errors=True)
        self._release()
