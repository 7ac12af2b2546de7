"""Bounds on a GGUF file's metadata, checked before gguf-py or transformers parse it.

gguf-py's reader builds a Python object per array element and per string byte range, and transformers
parses every value again: a 100 MB metadata string cost 4.9 GB and three minutes. The header is walked
here instead (the GGUF layout, v2 and v3: magic, version, tensor and key counts, then each key with its
typed value; arrays of fixed-size elements are skipped by their byte length, arrays of strings one length
at a time), and a file whose counts or sizes exceed the limits below is refused naming the value. The
limits sit far above what llama.cpp writes for real models (Gemma 3's 262,144-token vocabulary and its
merges; chat templates of tens of kilobytes).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from fp8ptq.errors import ModelError

MAX_KEYS = 1 << 16  # metadata entries
MAX_TENSORS = 1 << 20
MAX_STRING_BYTES = 8 << 20  # one key or string value (a chat template, a token)
MAX_ARRAY_ITEMS = 16 << 20  # one array (a vocabulary, its merges)
MAX_METADATA_BYTES = 512 << 20  # the whole metadata section

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9


class _Walk:
    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ModelError(
                f"'{self.path}' is truncated or corrupt (it ends inside its GGUF metadata)", fix="re-download it"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self, what: str) -> None:
        n = self.u64()
        _bound(self.path, what, n, MAX_STRING_BYTES, "bytes")
        self.take(n)

    def value(self, vtype: int, key: str) -> None:
        if vtype in _SCALAR:
            self.take(_SCALAR[vtype])
        elif vtype == _STRING:
            self.string(f"metadata value '{key}'")
        elif vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            _bound(self.path, f"metadata array '{key}'", count, MAX_ARRAY_ITEMS, "items")
            if etype in _SCALAR:
                self.take(count * _SCALAR[etype])
            elif etype == _STRING:
                for _ in range(count):
                    self.string(f"a string of metadata array '{key}'")
            else:  # nested arrays: llama.cpp writes none
                raise ModelError(
                    f"'{self.path}': metadata array '{key}' holds type {etype}", fix="use a GGUF llama.cpp wrote"
                )
        else:
            raise ModelError(
                f"'{self.path}': metadata '{key}' has unknown type {vtype}", fix="use a GGUF llama.cpp wrote"
            )


def _bound(path: Path, what: str, n: int, limit: int, unit: str) -> None:
    if n > limit:
        raise ModelError(
            f"'{path}': {what} declares {n:,} {unit} (limit {limit:,}): a file no converter writes",
            fix="use a GGUF written by llama.cpp's converter; fp8ptq does not parse metadata this large",
        )


def check_metadata(path: Path) -> None:
    """ModelError unless `path` is a GGUF whose metadata stays within the limits above (reads only the
    header, through a memory map)."""
    if not Path(path).is_file():  # a FIFO or device would block the open or never end
        raise ModelError(f"'{path}' is not a regular file", fix="pass a .gguf file")
    with open(path, "rb") as f:
        if Path(path).stat().st_size < 24:
            raise ModelError(f"'{path}' is too short to be a GGUF file", fix="pass a .gguf file written by llama.cpp")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            w = _Walk(buf, Path(path))
            if w.take(4) != b"GGUF":
                raise ModelError(f"'{path}' is not a GGUF file (no GGUF magic)", fix="pass a .gguf file")
            version = w.u32()
            if version not in (2, 3):
                raise ModelError(f"'{path}': GGUF version {version}", fix="use a GGUF v2 or v3 file")
            tensors, keys = w.u64(), w.u64()
            _bound(path, "the tensor count", tensors, MAX_TENSORS, "tensors")
            _bound(path, "the metadata count", keys, MAX_KEYS, "entries")
            for _ in range(keys):
                n = w.u64()
                _bound(path, "a metadata key", n, MAX_STRING_BYTES, "bytes")
                key = bytes(w.take(n)).decode("utf-8", errors="replace")
                w.value(w.u32(), key)
                _bound(path, "the metadata", w.pos, MAX_METADATA_BYTES, "bytes")
