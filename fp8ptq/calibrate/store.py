"""Where the calibration hidden states live between decoder layers: RAM, or a file on disk.

The pipeline reads one chunk of samples, runs it through a block of the current layer and writes the
result back in place. `offload=True` keeps the states in a file and reads/writes chunks with
pread/pwrite (no mmap: mapped file pages would count in the process's RSS), so RAM holds one chunk.
`save`/`load` checkpoint the states at a layer boundary for `--resume` (written atomically).
In RAM means on `device`: a GPU run keeps the states in GPU memory when they fit (calibrate/state.py),
so no pass copies them between host and device.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from fp8ptq.io import write_atomic

_DTYPE = torch.float32  # calibration flows in fp32: isolates quantization error from bf16 noise


class ActivationStore:
    def __init__(self, samples: int, seq_len: int, hidden: int, offload_dir: Path | None = None, device=None):
        self.shape = (samples, seq_len, hidden)
        self.row_bytes = seq_len * hidden * 4  # one sample
        self.path: Path | None = None
        self._fd: int | None = None
        self._mem: torch.Tensor | None = None
        if offload_dir is None:
            self._mem = torch.zeros(self.shape, dtype=_DTYPE, device=device or "cpu")
        else:
            offload_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="activations-", suffix=".f32", dir=offload_dir)
            self.path, self._fd = Path(name), fd
            os.ftruncate(fd, samples * self.row_bytes)

    @property
    def device(self) -> torch.device | None:
        """Where a RAM store lives (None: offloaded to disk)."""
        return None if self._mem is None else self._mem.device

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def read(self, start: int, stop: int, copy: bool = True) -> torch.Tensor:
        """Samples [start, stop) as a new fp32 tensor [n, seq, hidden] (on the store's device); copy=False:
        a view of a RAM store when the caller reads it before writing those rows (the pipeline's passes)."""
        if self._mem is not None:
            return self._mem[start:stop].clone() if copy else self._mem[start:stop]
        n = stop - start
        buf = bytearray(n * self.row_bytes)
        view, off, done = memoryview(buf), start * self.row_bytes, 0
        while done < len(buf):
            got = os.preadv(self._fd, [view[done:]], off + done)
            if got <= 0:
                raise OSError(f"short read from {self.path}")
            done += got
        return torch.frombuffer(buf, dtype=_DTYPE).reshape(n, *self.shape[1:])

    def write(self, start: int, x: torch.Tensor) -> None:
        x = x.detach().to(self._mem.device if self._mem is not None else "cpu", _DTYPE).contiguous()
        if self._mem is not None:
            self._mem[start : start + x.shape[0]] = x
            return
        data, off = memoryview(x.numpy()).cast("B"), start * self.row_bytes
        while data:
            n = os.pwrite(self._fd, data, off)
            data, off = data[n:], off + n

    def save(self, path: Path) -> None:
        """Atomically write all states to `path` (a resume checkpoint)."""

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                step = max(1, (256 << 20) // self.row_bytes)
                for i in range(0, self.shape[0], step):
                    f.write(memoryview(self.read(i, min(i + step, self.shape[0])).cpu().numpy()).cast("B"))

        write_atomic(path, write)

    def load(self, path: Path) -> None:
        if path.stat().st_size != self.nbytes:
            raise ValueError(f"checkpoint {path} has {path.stat().st_size} bytes, expected {self.nbytes}")
        step = max(1, (256 << 20) // self.row_bytes)
        with open(path, "rb") as f:
            for i in range(0, self.shape[0], step):
                n = min(step, self.shape[0] - i)
                buf = bytearray(f.read(n * self.row_bytes))
                self.write(i, torch.frombuffer(buf, dtype=_DTYPE).reshape(n, *self.shape[1:]))

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)
        self._mem = None
