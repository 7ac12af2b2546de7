"""Join the per-layer safetensors files of a finished export into conventional shards, one tensor's bytes in
memory at a time.

safetensors' own writer takes every tensor of a file in memory at once (and copies each to bytes), so a
merged shard would cost twice its size in RAM; the format itself is a little-endian u64 header length, a
JSON header of name -> dtype, shape and byte range, then the bytes. The parts' headers are read and their
bytes copied in the order safetensors itself writes them (larger element types first, then by name, so
every tensor starts at a multiple of its element size), and the result is opened by the safetensors library
before it is renamed into place.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from fp8ptq.io import write_atomic

# bytes per element of safetensors' dtype names (its own table, as written in headers)
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_ITEMSIZE |= {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}
COPY_BYTES = 16 << 20  # the bounded buffer each tensor's bytes pass through


def read_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, the JSON header) of a safetensors file fp8ptq wrote."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def merge(parts: list[Path], dest: Path, metadata: dict[str, str] | None = None) -> list[str]:
    """Write the tensors of `parts` (disjoint names) as one safetensors file at `dest` (atomically); returns
    the tensor names. The parts are left in place (the caller removes them once the merged file is in)."""
    entries = []  # (itemsize, name, part, absolute begin, byte length, dtype, shape)
    for part in parts:
        start, header = read_header(part)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            entries.append((_ITEMSIZE[info["dtype"]], name, part, start + b, e - b, info["dtype"], info["shape"]))
    names = [e[1] for e in entries]
    assert len(set(names)) == len(names), "a tensor appears in two parts"
    entries.sort(key=lambda e: (-e[0], e[1]))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for _, name, _, _, length, dtype, shape in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + length]}
        offset += length
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned, as safetensors pads it

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(blob)) + blob)
            for _, _, part, begin, length, _, _ in entries:
                with open(part, "rb") as f:
                    f.seek(begin)
                    _copy(f, out, length)
        from safetensors import safe_open

        with safe_open(str(tmp), framework="pt") as h:  # the library's own parser accepts what was written
            assert sorted(h.keys()) == sorted(names), "merged shard lost tensors"

    write_atomic(dest, write)
    return names


def _copy(src, dst, length: int) -> None:
    left = length
    while left:
        chunk = src.read(min(left, COPY_BYTES))
        if not chunk:
            raise OSError(f"{src.name} ended {left} bytes early")
        dst.write(chunk)
        left -= len(chunk)
