"""A GGUF's metadata is bounded before gguf-py or transformers parse it (models/gguf_limits.py)."""

import os
import struct
import time

import pytest

from fp8ptq.errors import ModelError
from fp8ptq.models.gguf import open_reader

pytestmark = pytest.mark.tiny


def _header(keys: list[bytes]) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(keys)) + b"".join(keys)


def _string_kv(key: str, n: int) -> bytes:  # declares a string value of n bytes, holds n bytes
    k = key.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<IQ", 8, n) + b"A" * n


def test_a_huge_metadata_string_is_refused_before_parsing(tmp_path):
    f = tmp_path / "big.gguf"
    f.write_bytes(_header([_string_kv("general.architecture", 5), _string_kv("tokenizer.chat_template", 9 << 20)]))
    t = time.perf_counter()
    with pytest.raises(ModelError, match=r"tokenizer.chat_template' declares 9,437,184 bytes \(limit"):
        open_reader(f)
    assert time.perf_counter() - t < 5


def test_an_array_declaring_a_billion_items_is_refused(tmp_path):
    k = b"tokenizer.ggml.tokens"
    kv = struct.pack("<Q", len(k)) + k + struct.pack("<IIQ", 9, 8, 10**9)  # array of strings, no data
    f = tmp_path / "arr.gguf"
    f.write_bytes(_header([kv]))
    with pytest.raises(ModelError, match="1,000,000,000 items"):
        open_reader(f)


def test_truncated_metadata_and_fifos_are_one_line_errors(tmp_path):
    f = tmp_path / "short.gguf"
    f.write_bytes(_header([_string_kv("general.architecture", 5)])[:-3])
    with pytest.raises(ModelError, match="truncated or corrupt"):
        open_reader(f)
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    with pytest.raises(ModelError, match="not a regular file"):
        open_reader(fifo)  # would block forever in open()
