"""The machine failing under a command (issue 32, item 6): a full disk or a file-size limit, a path it
may not write, a busy file, Ctrl-C during the final rename. Each is one `error:` line naming the path and
the fix, exit 2, no traceback, and no complete-looking output; a quantize run keeps its finished layers
for --resume. The failures are real: the kernel's file-size limit (RLIMIT_FSIZE) makes writes fail with
EFBIG the way a full disk fails them with ENOSPC, and both reach fp8ptq through the same paths."""

from __future__ import annotations

import errno
import os
import resource
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from fp8ptq.io import OUTPUT_MARKER, environment_error, replace_dir

from helpers import QUICK, assert_one_line_error, run_cli

pytestmark = pytest.mark.tiny


@contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored) in this process, then the limit goes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


@pytest.fixture(scope="module")
def tiny_gguf_file(tiny_dir, tmp_path_factory) -> Path:
    from helpers import write_gguf

    return write_gguf(tiny_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", {}, "F16")


@pytest.mark.parametrize("cmd", ["quantize", "analyze", "convert"])
def test_a_write_the_machine_refuses_is_one_line(cmd, tiny_dir, tiny_gguf_file, tmp_path):
    out = tmp_path / "out"
    args = {
        "quantize": ["quantize", tiny_dir, "-o", out, *QUICK],
        "analyze": ["analyze", tiny_dir, "-o", out, "--num-samples", "2", "--seq-len", "32"],
        "convert": ["convert", tiny_gguf_file, "-o", out, "--to", "hf"],
    }[cmd]
    with file_size_limit(16 << 10):  # the tiny model's weights are ~300 KiB; every JSON file fits
        rc, output = run_cli(*args)
    line = assert_one_line_error(rc, output, "file too large", str(out), "fix:")
    assert not out.exists()  # nothing complete-looking
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")]
    if cmd == "quantize" and leftovers:  # kept only with finished layers, and the line says how to go on
        assert "--resume" in line and leftovers == [".out.partial"], (line, leftovers)
    else:
        assert leftovers == [], leftovers


def test_save_naming_a_folder_or_a_device_is_refused_before_any_work(tiny_dir, tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for save, phrase in ((tmp_path, "is a directory"), (fifo, "not a regular file")):
        rc, output = run_cli("spec", "measure", tiny_dir, "ngram:2-3", "--gammas", "1", "--save", save)
        assert_one_line_error(rc, output, phrase)
        assert "acceptance" not in output.lower()  # refused before measuring
    assert fifo.exists() and not fifo.is_file()


def test_ctrl_c_during_the_final_rename_loses_neither_result(tmp_path, monkeypatch):
    out, new = tmp_path / "out", tmp_path / ".out.partial-x"
    out.mkdir()
    (out / OUTPUT_MARKER).write_text("")
    (out / "old.txt").write_text("old")
    new.mkdir()
    (new / "new.txt").write_text("new")
    approved = (os.lstat(out).st_dev, os.lstat(out).st_ino)
    real_replace = os.replace

    def replace_then_interrupt(a, b):  # Ctrl-C arrives between moving the old result away and the new in
        real_replace(a, b)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_interrupt)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, whatever ran before
    try:
        with pytest.raises(KeyboardInterrupt):
            replace_dir(new, out, approved)
    finally:
        signal.signal(signal.SIGINT, before)
    assert (out / "new.txt").read_text() == "new"  # the signal waited until the new result was in place


def test_gguf_that_declares_more_blocks_than_it_holds_is_refused(tiny_dir, tmp_path, monkeypatch):
    import fp8ptq.conversion.gguf_meta as meta

    from helpers import write_gguf

    real = meta.add_metadata

    def five_blocks(writer, config, *args):  # the metadata says 5 blocks; the tensors are those of 2
        config.num_hidden_layers = 5
        real(writer, config, *args)

    monkeypatch.setattr(meta, "add_metadata", five_blocks)
    gguf = write_gguf(tiny_dir, tmp_path / "five.gguf", {}, "F16")
    monkeypatch.undo()
    rc, output = run_cli("quantize", gguf, "-o", tmp_path / "out", *QUICK)
    assert_one_line_error(rc, output, "declares 5 blocks", "block 2")
    rc, output = run_cli("inspect", gguf)
    assert rc == 1 and "gguf-incomplete" in output, output


def test_environment_errors_are_told_from_bugs():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert "no space left" in str(environment_error(full, "out"))
    rust = RuntimeError("Error while serializing: I/O error: Read-only file system (os error 30)")
    assert "read-only" in str(environment_error(rust, "out"))
    wrapped = ValueError("while writing")
    wrapped.__cause__ = PermissionError(errno.EACCES, "Permission denied", "/x/.y.tmp")
    assert "'out'" in str(environment_error(wrapped, Path("out")))  # a temp file is named by its output
    assert environment_error(KeyError("model.norm.weight")) is None  # a bug stays a traceback
    assert environment_error(OSError(errno.ECONNRESET, "reset")) is None
