"""Bounds on a GGUF file's metadata, checked before gguf-py or transformers parse it.

gguf-py's reader builds a Python object per array element and per string byte range, and transformers
parses every value again: a 100 MB metadata string cost 4.9 GB and three minutes. The header is walked
here instead (the GGUF layout, v2 and v3: magic, version, tensor and key counts, then each key with its
typed value; arrays of fixed-size elements are skipped by their byte length, arrays of strings one length
at a time), and a file whose counts or sizes exceed the limits below is refused naming the value, as is
one whose tokenizer arrays disagree, hold non-UTF-8 strings or whose special-token ids fall outside them. The
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


# The tokenizer's parallel arrays (one entry per token) and the ids that index them: transformers zips the
# arrays and indexes the vocabulary with the ids, so a disagreement is an IndexError deep in its converter.
_PER_TOKEN = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
_TOKEN_IDS = tuple(f"tokenizer.ggml.{n}_token_id" for n in ("bos", "eos", "unknown", "padding", "seperator"))
_U32, _I32 = 4, 5


class _Walk:
    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos = buf, path, 0
        self.counts: dict[str, int] = {}  # _PER_TOKEN key -> items
        self.ids: dict[str, int] = {}  # _TOKEN_IDS key -> value

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

    def string(self, what: str, text: bool = False) -> None:
        """Skip one string; `text`: it must be UTF-8 (tokens and merges, which the tokenizer decodes)."""
        n = self.u64()
        _bound(self.path, what, n, MAX_STRING_BYTES, "bytes")
        raw = self.take(n)
        if text:
            try:
                bytes(raw).decode("utf-8")
            except UnicodeDecodeError:
                raise ModelError(
                    f"'{self.path}': {what} is not UTF-8 ({bytes(raw[:32])!r})", fix="use a GGUF llama.cpp wrote"
                ) from None

    def value(self, vtype: int, key: str) -> None:
        if vtype in (_U32, _I32) and key in _TOKEN_IDS:
            self.ids[key] = struct.unpack("<I" if vtype == _U32 else "<i", self.take(4))[0]
        elif vtype in _SCALAR:
            self.take(_SCALAR[vtype])
        elif vtype == _STRING:
            self.string(f"metadata value '{key}'")
        elif vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            _bound(self.path, f"metadata array '{key}'", count, MAX_ARRAY_ITEMS, "items")
            if key in _PER_TOKEN:
                self.counts[key] = count
            if etype in _SCALAR:
                self.take(count * _SCALAR[etype])
            elif etype == _STRING:
                text = key.startswith("tokenizer.ggml.")
                for i in range(count):
                    self.string(f"item {i} of metadata array '{key}'", text)
            else:  # nested arrays: llama.cpp writes none
                raise ModelError(
                    f"'{self.path}': metadata array '{key}' holds type {etype}", fix="use a GGUF llama.cpp wrote"
                )
        else:
            raise ModelError(
                f"'{self.path}': metadata '{key}' has unknown type {vtype}", fix="use a GGUF llama.cpp wrote"
            )

    def check_tokenizer(self) -> None:
        """The per-token arrays agree in length and the special-token ids index the vocabulary."""
        if len(set(self.counts.values())) > 1:
            sizes = ", ".join(f"{k.rsplit('.', 1)[1]} {n:,}" for k, n in self.counts.items())
            raise ModelError(
                f"'{self.path}': its tokenizer arrays disagree in length ({sizes})", fix="use a GGUF llama.cpp wrote"
            )
        vocab = self.counts.get(_PER_TOKEN[0])
        for key, token_id in self.ids.items():
            if vocab is not None and token_id >= vocab:  # a negative int32 id means none
                raise ModelError(
                    f"'{self.path}': {key} is {token_id}, outside its {vocab:,}-token vocabulary",
                    fix="use a GGUF llama.cpp wrote",
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
            w.check_tokenizer()
