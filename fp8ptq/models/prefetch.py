"""The next decoder layer read while this one calibrates: I/O off the critical path.

On a GPU the sequential pipeline would otherwise stop between layers to read the next layer's shards,
check them on the host and send them by a blocking pageable copy. A reader thread copies layer i+1's
stored tensors (in their stored dtype, half the bytes of fp32 for bf16) into pinned host memory while
layer i calibrates; the main thread then queues non-blocking copies, widens to fp32 on the device and
checks finiteness there with one host sync for the whole layer. The values are those `materialize`
loads (a widening cast is exact), so outputs do not change.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from fp8ptq.models.loader import ModelSource, check_finite
from fp8ptq.models.skeleton import stored_sources

# A layer larger than this is loaded the plain way: pinning a DeepSeek-V3 MoE layer (~11 GiB in bf16)
# would take that much page-locked host memory for a gain that is small beside its calibration.
PREFETCH_MAX_BYTES = 4 << 30


class LayerPrefetch:
    """Reads layers[i]'s stored tensors in a thread: `start(i)`, then `load(i, device, dtype)` on the layer."""

    def __init__(self, src: ModelSource, layers, pin: bool):
        self.src = replace(src, _handles={})  # its own memory maps: the main thread closes its own between layers
        self.layers, self.pin = layers, pin
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp8ptq-prefetch")
        self.pending: dict[int, Future] = {}

    def names(self, i: int) -> dict[str, str]:
        return stored_sources(self.layers[i], self.src.arch.layer_prefix(i), self.src)

    def start(self, i: int) -> None:
        """Begin reading layers[i] unless it is too large to pin (then `load` reads it in the caller)."""
        if i < len(self.layers) and i not in self.pending:
            try:
                names = self.names(i)
            except KeyError:
                return  # `load` raises it, when that layer's turn comes
            if sum(self.src.tensor_bytes(f) for f in names.values()) <= PREFETCH_MAX_BYTES:
                self.pending[i] = self.pool.submit(self._read, names)

    def _read(self, names: dict[str, str]) -> dict[str, torch.Tensor]:
        out = {}
        for name, full in names.items():
            t = self.src.tensor(full)
            out[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin).copy_(t)
            del t
        self.src.close()  # the pages are in `out` now; the mappings would keep them in RSS too
        return out

    def load(self, i: int, device: torch.device, dtype: torch.dtype) -> None:
        """Load layers[i] (as `materialize` would) from its prefetched host tensors."""
        future = self.pending.pop(i, None)
        names = self.names(i)
        host = future.result() if future is not None else self._read(names)
        state = {n: t.to(device, non_blocking=True) for n, t in host.items()}
        del host  # pinned blocks go back to torch's host cache only once their copies have completed
        state = {n: t.to(dtype) for n, t in state.items()}  # every stored tensor, as materialize does
        filled = [n for n, t in state.items() if t.numel()]
        if filled:  # one host sync per layer: min and max propagate NaN and hold any inf
            ends = torch.stack([torch.stack(torch.aminmax(state[n])) for n in filled])
            if not bool(torch.isfinite(ends).all()):
                for n in filled:
                    check_finite(names[n], state[n])  # raises, naming the first broken tensor
        self.layers[i].load_state_dict(state, strict=False, assign=True)

    def close(self) -> None:
        for f in self.pending.values():
            f.cancel()
        self.pool.shutdown(wait=True)
        self.pending.clear()
        self.src.close()
