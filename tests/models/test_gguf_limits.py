"""A GGUF's metadata is bounded before gguf-py or transformers parse it (models/gguf_limits.py)."""

import os
import re
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


def _key(key: str) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode()


def _strings_kv(key: str, items: list[bytes]) -> bytes:
    return _key(key) + struct.pack("<IIQ", 9, 8, len(items)) + b"".join(struct.pack("<Q", len(s)) + s for s in items)


def _floats_kv(key: str, n: int) -> bytes:
    return _key(key) + struct.pack("<IIQ", 9, 6, n) + b"\0" * (4 * n)


@pytest.mark.parametrize(
    "keys, phrase",
    [
        (
            [_strings_kv("tokenizer.ggml.tokens", [b"a", b"b", b"c"]), _floats_kv("tokenizer.ggml.scores", 2)],
            "tokenizer arrays disagree in length (tokens 3, scores 2)",
        ),
        (
            [_strings_kv("tokenizer.ggml.tokens", [b"a", b"b"]), _strings_kv("tokenizer.ggml.merges", [b"a \xff"])],
            "item 0 of metadata array 'tokenizer.ggml.merges' is not UTF-8",
        ),
        (
            [
                _strings_kv("tokenizer.ggml.tokens", [b"a", b"b"]),
                _key("tokenizer.ggml.bos_token_id") + struct.pack("<II", 4, 7),
            ],
            "bos_token_id is 7, outside its 2-token vocabulary",
        ),
    ],
)
def test_a_tokenizer_that_transformers_would_trip_on_is_refused_by_name(keys, phrase, tmp_path):
    f = tmp_path / "tok.gguf"
    f.write_bytes(_header([_string_kv("general.architecture", 5), *keys]))
    with pytest.raises(ModelError, match=re.escape(phrase)):
        open_reader(f)
