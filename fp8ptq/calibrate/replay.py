"""Fewer forwards per layer: a block's module outputs computed in one pass are reused by its later passes.

Within one residual block the staged pipeline runs several passes over every chunk (the first group's
stats, the KV scales, the next group's stats, ...), each from the block's input. Between those passes
the block's input does not change, nor does a module once it is final: the norm (always), and a group
after its stage quantized it (its weights and input quantizer are installed). So the first later pass
that runs such a module records its output per chunk, and the passes after that replay it instead of
recomputing (for a Llama layer: the attention norm once instead of three times, q/k/v projections once
instead of twice). The replayed tensors are exactly those the module computed, so results are bit for
bit those of recomputing. Recording is bounded by a byte budget (what does not fit is recomputed).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch


class Replay:
    def __init__(self, modules: dict[str, torch.nn.Module], budget: int, tokens: int):
        # `at`: the chunk being run, set by the pass (a plain int, not a callback into the calibrator: a
        # cycle calibrator -> replay -> closure -> calibrator would keep every finished layer's fp32
        # modules alive until the garbage collector runs, and peak RSS would grow with depth)
        self.modules, self.budget, self.tokens, self.at = modules, budget, tokens, 0
        self.saved: dict[str, dict[int, torch.Tensor]] = {}  # module -> chunk -> output (complete passes only)
        self.wanted: dict[str, int] = {}  # module -> bytes it will take: record in the next pass that runs it
        self.active: set[torch.nn.Module] = set()  # modules replayed in the current pass
        self.used = 0

    def want(self, names, width_of: Callable[[str], int]) -> None:
        """Record these modules' outputs in the next pass that runs them, all of them if they fit."""
        names = [n for n in names if n not in self.saved and "forward" not in self.modules[n].__dict__]
        need = {n: self.tokens * width_of(n) * 4 for n in names}
        if names and self.used + sum(need.values()) <= self.budget:
            self.wanted.update(need)
            self.used += sum(need.values())

    def clear(self) -> None:
        self.saved, self.wanted, self.active, self.used = {}, {}, set(), 0

    @contextmanager
    def during_pass(self):
        """Replay what is saved, record what is wanted; keep a recording only if every chunk made one."""
        recording: dict[str, dict[int, torch.Tensor]] = {n: {} for n in self.wanted}
        handles = []
        for n, out in self.saved.items():
            m = self.modules[n]
            m.forward = lambda *_a, _out=out, **_k: _out[self.at].clone()  # clone: callers may write
            self.active.add(m)
        twice: set[str] = set()  # called more than once per chunk: its output is not one tensor per chunk

        def record(n: str, rec: dict):
            def hook(_m, _args, y):
                if self.at in rec:
                    twice.add(n)
                rec[self.at] = y

            return hook

        for n, rec in recording.items():
            handles.append(self.modules[n].register_forward_hook(record(n, rec)))
        chunks: set[int] = set()
        try:
            yield chunks
        finally:
            for h in handles:
                h.remove()
            for m in self.active:
                del m.forward
            self.active = set()
        for n, rec in recording.items():
            if rec and set(rec) == chunks and n not in twice:
                self.saved[n] = rec
                del self.wanted[n]
