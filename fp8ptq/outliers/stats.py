"""Activation statistics: one code path for calibration scales, outlier analysis, smoothing and flattening.

`ActStats` follows one activation stream x [samples, seq, channels] chunk by chunk (see
fp8ptq/dist.py for why chunks) and keeps only what its `StatsSpec` asks for:

- per-channel abs-max (always; the per-tensor max, the observer input, is its max),
- a deterministic row subsample (every `stride`-th global row) for percentiles, MSE scale search and
  SmoothQuant's alpha search,
- float64 moment sums (mean / variance / kurtosis of the values),
- each sample's top-k channels by abs-max (are the outlier channels the same for every input?).

`reduce(comm)` makes the statistics global (max, ordered gathers, tree sums): identical on every rank
and equal to a 1-process run. `summary()` turns them into the numbers `fp8ptq analyze` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp8ptq.dist import TreeSum

MAX_SUBSAMPLE_ELEMENTS = 1 << 24  # torch.quantile's input limit; also bounds memory (64 MiB fp32)


@dataclass(frozen=True)
class StatsSpec:
    rows: int = 0  # rows to keep in the subsample (0: none); capped so rows*channels <= 2^24
    moments: bool = False
    sample_top: int = 0  # per-sample top-k outlier channels (0: off)


@dataclass
class ActStats:
    spec: StatsSpec
    channels: int
    total_rows: int  # rows in the whole calibration set (all ranks): fixes the subsample stride
    seq_len: int
    channel_amax: torch.Tensor | None = None
    _rows: list = field(default_factory=list)  # (first global row, tensor) per chunk
    _moments: TreeSum = field(default_factory=TreeSum)
    _tops: list = field(default_factory=list)  # (sample index, [channels]) per sample
    rows: torch.Tensor | None = None  # after reduce(): the global subsample [r, channels]
    moments: torch.Tensor | None = None  # after reduce(): [count, sum, sum2, sum3, sum4] float64
    sample_tops: list = field(default_factory=list)
    _amax: float | None = field(default=None, repr=False)  # amax, read once (a host sync on a GPU)

    @property
    def stride(self) -> int:
        keep = min(self.spec.rows, max(1, MAX_SUBSAMPLE_ELEMENTS // max(1, self.channels)))
        return max(1, -(-self.total_rows // max(1, keep)))

    def update(self, chunk: int, first_sample: int, x: torch.Tensor) -> None:
        """x [n, seq, channels] for samples first_sample.. of global chunk `chunk`."""
        flat = x.detach().reshape(-1, x.shape[-1])
        self._amax = None
        cmax = flat.abs().amax(dim=0).float() if flat.shape[0] else torch.zeros(x.shape[-1], device=x.device)
        self.channel_amax = cmax if self.channel_amax is None else torch.maximum(self.channel_amax, cmax)
        if self.spec.rows:
            first_row = first_sample * self.seq_len
            start = (-first_row) % self.stride  # global row indices that are multiples of stride
            self._rows.append((first_row + start, flat[start :: self.stride].float().cpu()))
        if self.spec.moments:
            v = flat.double()
            self._moments.add(
                chunk,
                torch.stack(
                    [
                        torch.tensor(float(v.numel()), dtype=torch.float64, device=v.device),
                        v.sum(),
                        (v * v).sum(),
                        v.pow(3).sum(),
                        v.pow(4).sum(),
                    ]
                ),
            )
        if self.spec.sample_top:
            per_sample = x.detach().abs().amax(dim=1).float()  # [n, channels]
            k = min(self.spec.sample_top, per_sample.shape[-1])
            top = per_sample.topk(k, dim=-1).indices.cpu().tolist()
            self._tops.extend((first_sample + i, t) for i, t in enumerate(top))

    def reduce(self, comm) -> ActStats:
        assert self.channel_amax is not None or comm.world > 1, "no data observed"
        cmax = self.channel_amax
        if comm.world > 1:
            if cmax is None:  # a rank without chunks still takes part in the collective
                cmax = torch.zeros(self.channels)
            cmax = comm.max_(cmax.clone())
        self.channel_amax = cmax
        self._amax = None
        if self.spec.rows:
            parts = [p for rank_parts in comm.gather_objects(self._rows) for p in rank_parts]
            parts.sort(key=lambda p: p[0])
            self.rows = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, self.channels)
            self._rows = []
        if self.spec.moments:
            self.moments = self._moments.total(comm)
        if self.spec.sample_top:
            self.sample_tops = sorted(t for rank_tops in comm.gather_objects(self._tops) for t in rank_tops)
        return self

    @property
    def amax(self) -> float:
        if self._amax is None:
            self._amax = float(self.channel_amax.max())
        return self._amax

    def summary(self, top: int = 8, outlier_factor: float = 8.0) -> dict:
        """Numbers for reports. Channel outliers: abs-max above `outlier_factor` x the median channel's."""
        cmax = self.channel_amax.float().cpu()
        med = float(cmax.median())
        order = torch.argsort(cmax, descending=True)[:top].tolist()
        out = {
            "amax": float(cmax.max()),
            "channel_amax_median": med,
            "outlier_channels": int((cmax > outlier_factor * max(med, 1e-12)).sum()),
            "top_channels": [
                {"channel": c, "amax": float(cmax[c]), "x_median": float(cmax[c]) / max(med, 1e-12)} for c in order
            ],
        }
        if self.rows is not None and self.rows.numel():
            a = self.rows.abs().flatten()
            qs = torch.quantile(a, torch.tensor([0.5, 0.99, 0.999, 0.9999]))
            out["percentiles"] = {
                "p50": float(qs[0]),
                "p99": float(qs[1]),
                "p99.9": float(qs[2]),
                "p99.99": float(qs[3]),
            }
            out["max_over_p99"] = out["amax"] / max(float(qs[1]), 1e-12)
        if self.moments is not None:
            n, s1, s2, s3, s4 = (float(v) for v in self.moments)
            mean = s1 / n
            var = max(s2 / n - mean * mean, 1e-30)
            m4 = s4 / n - 4 * mean * s3 / n + 6 * mean * mean * s2 / n - 3 * mean**4
            out.update(mean=mean, std=var**0.5, kurtosis=m4 / var**2)
        if self.sample_tops:
            k = len(self.sample_tops[0][1])
            glob = order[:k]
            hits = {c: 0 for c in glob}
            for _, chans in self.sample_tops:
                for c in set(chans) & set(glob):
                    hits[c] += 1
            n = len(self.sample_tops)
            # stability: how often each global top channel is also in a sample's own top-k
            out["top_channel_stability"] = {str(c): hits[c] / n for c in glob}
            out["stability_mean"] = sum(hits.values()) / (n * max(1, len(glob)))
        return out


def massive_activations(
    h: torch.Tensor, first_sample: int, top: int = 8, min_abs: float = 100.0, min_ratio: float = 1000.0
) -> list[dict]:
    """Massive activations (Sun et al., 2024) in a residual stream h [n, seq, hidden]: single values
    above `min_abs` and `min_ratio` x the median |h|. Returns the largest `top` as dicts."""
    a = h.detach().abs().float()
    med = float(a.flatten()[:: max(1, a.numel() // 65536)].median())
    thresh = max(min_abs, min_ratio * med)
    flat = a.flatten()
    k = min(top, flat.numel())
    vals, idx = flat.topk(k)
    out = []
    n, seq, hidden = a.shape
    for v, i in zip(vals.tolist(), idx.tolist()):
        if v <= thresh:
            break
        s, rest = divmod(i, seq * hidden)
        pos, ch = divmod(rest, hidden)
        out.append(
            {"sample": first_sample + s, "position": pos, "channel": ch, "abs": v, "x_median": v / max(med, 1e-12)}
        )
    return out
