"""Calibration across processes (torch.distributed) with results that do not depend on the split.

Samples are cut into fixed chunks (same chunks whatever the world size); each rank owns a contiguous
run of chunks. Statistics are combined so that a W-rank run computes exactly what a 1-rank run does:

- maxima: all-reduce MAX (associative, exact);
- sums (GPTQ Hessians, moments): `TreeSum` adds per-chunk partials in one fixed binary tree over the
  global chunk index. A rank's chunks form an aligned subtree when W is a power of two, so every rank
  computes its subtree exactly as the 1-rank run does and the roots are combined in the same tree:
  bit-identical. For other W the ranks' sums are added in rank order (equal up to float rounding);
- row subsamples: gathered in chunk order.

`LocalComm` is the 1-process case; `TorchComm` wraps an initialised default process group (gloo on
CPU, nccl on CUDA), as set up by `torchrun`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class ChunkPlan:
    """`samples` calibration samples cut into chunks of `chunk_samples`; which chunks this rank owns. The
    first `singles` samples are one chunk each (image+text samples whose layers take their own arguments:
    calibrate/images.py)."""

    samples: int
    chunk_samples: int
    rank: int = 0
    world: int = 1
    singles: int = 0

    @property
    def chunks(self) -> int:
        return self.singles + -(-(self.samples - self.singles) // self.chunk_samples)

    def owned(self, rank: int | None = None) -> range:
        rank = self.rank if rank is None else rank
        if is_pow2(self.world):  # aligned subtrees of the chunk tree (see TreeSum)
            span = max(1, _pow2_ceil(self.chunks) // self.world)
        else:
            span = -(-self.chunks // self.world)
        lo = min(rank * span, self.chunks)
        return range(lo, min(lo + span, self.chunks))

    def sample_range(self, chunk: int) -> range:
        if chunk < self.singles:
            return range(chunk, chunk + 1)
        lo = self.singles + (chunk - self.singles) * self.chunk_samples
        return range(lo, min(lo + self.chunk_samples, self.samples))

    def local_samples(self) -> range:
        """This rank's samples (contiguous)."""
        own = self.owned()
        if not len(own):
            return range(0)
        return range(self.sample_range(own[0]).start, self.sample_range(own[-1]).stop)


class LocalComm:
    """One process: every collective is the identity."""

    rank, world = 0, 1

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(self, t: torch.Tensor | None) -> list[torch.Tensor | None]:
        return [t]

    def gather_objects(self, obj) -> list:
        return [obj]

    def broadcast_object(self, obj, src: int = 0):
        return obj

    def barrier(self) -> None:
        pass


class TorchComm:
    """Collectives over the default torch.distributed process group."""

    def __init__(self):
        import torch.distributed as dist

        assert dist.is_initialized()
        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t

    def gather(self, t: torch.Tensor | None) -> list[torch.Tensor | None]:
        """All-gather possibly-absent tensors of one shape (a rank with no chunks sends None)."""
        meta = self.gather_objects(None if t is None else (tuple(t.shape), str(t.dtype)))
        ref = next((m for m in meta if m is not None), None)
        if ref is None:
            return [None] * self.world
        shape, dtype = ref[0], getattr(torch, ref[1].removeprefix("torch."))
        device = t.device if t is not None else _comm_device(self.dist)
        buf = t.contiguous() if t is not None else torch.zeros(shape, dtype=dtype, device=device)
        outs = [torch.empty_like(buf) for _ in range(self.world)]
        self.dist.all_gather(outs, buf)
        return [o if m is not None else None for o, m in zip(outs, meta)]

    def gather_objects(self, obj) -> list:
        out = [None] * self.world
        self.dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj, src: int = 0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        self.dist.barrier()


def _comm_device(dist) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init_from_env(device: str) -> TorchComm | LocalComm:
    """TorchComm when launched by torchrun (WORLD_SIZE > 1), else LocalComm. gloo on CPU, nccl on CUDA."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return LocalComm()
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    return TorchComm()


class TreeSum:
    """Sum of per-chunk tensors in a fixed binary tree over global chunk indices (see module doc).

    add() must be called with increasing chunk indices; memory is O(log chunks) partial sums."""

    def __init__(self):
        self._stack: list[tuple[int, int, torch.Tensor]] = []  # (first chunk, span, partial sum)

    def add(self, chunk: int, t: torch.Tensor) -> None:
        lo, span = chunk, 1
        while self._stack:
            plo, pspan, left = self._stack[-1]
            if pspan != span or plo + pspan != lo or (plo // pspan) % 2:
                break
            self._stack.pop()
            t, lo, span = left + t, plo, span * 2
        self._stack.append((lo, span, t))

    def local(self) -> torch.Tensor | None:
        """This rank's subtree: right fold of the stack (the canonical tree with absent chunks pruned)."""
        if not self._stack:
            return None
        total = self._stack[-1][2]
        for _, _, t in reversed(self._stack[:-1]):
            total = t + total
        return total

    def total(self, comm) -> torch.Tensor | None:
        """The global sum, identical on every rank."""
        parts = comm.gather(self.local())
        if is_pow2(len(parts)):
            while len(parts) > 1:  # balanced tree over ranks = the top of the chunk tree
                parts = [_add(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
            return parts[0]
        total = None
        for p in parts:
            total = _add(total, p)
        return total


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b
