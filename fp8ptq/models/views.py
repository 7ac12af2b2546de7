"""Views: tensors the model's modules name that the source files store in another layout.

transformers holds some tensors otherwise than checkpoints store them: experts fused into 3-D tensors,
q/k/v joined into one `query_key_value`, a conv split into three. fp8ptq reads a module's tensor through
its view of the stored ones (`read`, `shape` from the safetensors slices and shapes of `sources`), and an
export writes each module's tensors back in the stored layout (`write_back`), so the engine finds the
names and shapes the family's checkpoints have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8ptq.errors import ModelError

BUG = "please report this as an fp8ptq bug: the parts of a fused tensor are quantized together"


def leaf_name(stored: str, leaf: str, whole: bool) -> str:
    """The stored name of a module tensor `leaf` (`weight_scale`) beside a stored weight name; `whole`:
    the tensor is the stored one itself."""
    return stored if whole else f"{stored.removesuffix('.weight')}.{leaf}"


def one_value(ts: list[torch.Tensor], what: str, fix: str = BUG) -> torch.Tensor:
    """The value several parts of one fused tensor share (a per-tensor scale), or ModelError naming them."""
    if any(not torch.equal(t, ts[0]) for t in ts[1:]):
        raise ModelError(f"{what} carry different values of a per-tensor scale", fix=fix)
    return ts[0]


def joined(ts: list[torch.Tensor], dim: int, shape_tensor: bool, what: str, fix: str = BUG) -> torch.Tensor:
    """Tensors of the parts of one fused tensor as the fused one's: compressed-tensors' `weight_shape`
    with the parts' rows summed (`shape_tensor`), one value where each part has one (per-tensor scales),
    else concatenated along `dim`."""
    if shape_tensor:
        out = ts[0].clone()
        out[dim] = sum(int(t[dim]) for t in ts)
        return out
    if all(t.numel() == 1 for t in ts) or ts[0].dim() <= dim:
        return one_value(ts, what, fix)
    return torch.cat(ts, dim=dim)


@dataclass(frozen=True)
class SourceView:
    """A tensor the skeleton names that the source files store inside a fused one: `stored[index]`
    (rows `rows[0]:rows[1]` of it where the fused tensor stacks two Linears, as transformers'
    `gate_up_proj` [E, 2I, H] does), transposed when the file holds it [in, out] (gpt-oss's experts)
    rather than nn.Linear's [out, in]. An export writes it under its own (per-expert) name."""

    stored: str
    index: int
    transpose: bool = False
    rows: tuple[int, int] | None = None

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.stored,)

    def read(self, slices: list) -> torch.Tensor:
        # one expert's rows only (a safetensors slice reads just those)
        t = slices[0][self.index] if self.rows is None else slices[0][self.index, self.rows[0] : self.rows[1]]
        return t.t().contiguous() if self.transpose else t

    def shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        shape = tuple(shapes[0][1:])
        if self.rows is not None:
            shape = (self.rows[1] - self.rows[0], *shape[1:])
        return shape[::-1] if self.transpose else shape


@dataclass(frozen=True)
class JoinedView:
    """A tensor the skeleton names that the files store as several (transformers' Concatenate
    converter: olmo-hybrid's q/k/v_conv1d -> conv1d, a shared expert's gate/up -> gate_up_proj): their
    concatenation along `dim`. An export writes the parts back under their stored names."""

    parts: tuple[str, ...]
    dim: int = 0

    @property
    def sources(self) -> tuple[str, ...]:
        return self.parts

    def read(self, slices: list) -> torch.Tensor:
        return torch.cat([s[:] for s in slices], dim=self.dim)

    def shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        first = list(shapes[0])
        first[self.dim] = sum(s[self.dim] for s in shapes)
        return tuple(first)

    def write_back(self, name: str, t: torch.Tensor, shapes: list, whole: bool) -> dict[str, torch.Tensor]:
        """The tensor `name` of the module whose weight this view joins, as the parts' (of stored
        `shapes`): split along the view's axis where it spans it (weights, per-row scales, packed rows),
        each part's shape for compressed-tensors' `weight_shape`, the same value for each part where it
        has one (per-tensor scales). `whole`: `t` is the view's own tensor, not one beside it."""
        leaf = name.rpartition(".")[2]
        sizes = [s[self.dim] for s in shapes]
        total = sum(sizes)
        names = [leaf_name(p, leaf, whole) for p in self.parts]
        if leaf == "weight_shape":
            return {n: torch.tensor(list(s), dtype=t.dtype) for n, s in zip(names, shapes)}
        rows = t.shape[self.dim] if t.dim() > self.dim else 0
        if rows == total:
            return dict(zip(names, (c.contiguous() for c in torch.split(t, sizes, dim=self.dim))))
        if rows > 1 and total % rows == 0 and all(s % (total // rows) == 0 for s in sizes):  # packed rows
            pack = total // rows
            return dict(zip(names, (c.contiguous() for c in torch.split(t, [s // pack for s in sizes], self.dim))))
        if t.numel() == 1 or t.dim() <= self.dim:
            return {n: t.clone() for n in names}
        raise ModelError(
            f"'{name}': cannot write its '{leaf}' {list(t.shape)} back as the parts {self.parts} the files store"
        )


def rope_order(rows: int, heads: int) -> torch.Tensor:
    """The row order of transformers' PermuteForRope on a tensor of `heads` heads: each head's rows, stored
    as interleaved rotary pairs, regrouped as the two halves (`t[rope_order(...)]`; argsort: back)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


@dataclass(frozen=True)
class PartView:
    """One of several tensors the skeleton names that the files store fused in one (transformers'
    Split/Chunk converters: Bailing's `query_key_value` -> q/k/v_proj): `stored[start:stop]` along
    `dim`. An export writes the fused tensor back from all of `siblings` (the parts' names, in order)."""

    stored: str
    dim: int
    start: int
    stop: int
    siblings: tuple[str, ...]
    # a PermuteForRope after the split (rows, dim 0): per sibling, the heads whose rotary pairs it
    # regroups (0: rows as stored), and which sibling this view is; the files keep the stored order,
    # so an export writes the rows back in it
    rope: tuple[int, ...] = ()
    part: int = 0

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.stored,)

    def read(self, slices: list) -> torch.Tensor:
        if self.dim == 0:
            t = slices[0][self.start : self.stop]  # these rows only
            heads = self.rope[self.part] if self.rope else 0
            return t[rope_order(len(t), heads)] if heads else t
        return slices[0][:].narrow(self.dim, self.start, self.stop - self.start).contiguous()

    def shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        shape = list(shapes[0])
        shape[self.dim] = self.stop - self.start
        return tuple(shape)

    def write_back(self, leaf: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors `leaf` of the modules this view splits (q/k/v_proj; `parts` by tensor name), as the
        one fused tensor the files store (query_key_value)."""
        by_module = {n.rpartition(".")[0]: t for n, t in parts.items()}
        modules = [s.rpartition(".")[0] for s in self.siblings]
        missing = [m for m in modules if m not in by_module]
        if missing:
            raise ModelError(f"'{self.stored}' is stored fused: its parts {missing} have no '{leaf}'", fix=BUG)
        whole = leaf == self.siblings[0].rpartition(".")[2]  # the split tensor itself (a weight, a bias)
        ts = [by_module[m] for m in modules]
        if self.rope:
            ts = [self._stored_order(t, heads, leaf, whole) for t, heads in zip(ts, self.rope)]
        name = leaf_name(self.stored, leaf, whole)
        what = f"'{self.stored}' is stored fused, but its parts {modules}"
        return {name: joined(ts, self.dim, leaf == "weight_shape", what)}

    def _stored_order(self, t: torch.Tensor, heads: int, leaf: str, whole: bool) -> torch.Tensor:
        """A part's tensor `leaf` with its rows back in the order the files store them."""
        if not heads or t.numel() == 1:
            return t
        if not whole:  # a quantized Linear's scales or codes: rows not known to follow the weight's
            raise ModelError(
                f"'{self.stored}' stores its parts' rows in rotary order: cannot write their '{leaf}' back",
                fix="keep these Linears float (the recipe's ignore)",
            )
        return t[torch.argsort(rope_order(len(t), heads)).to(t.device)]


@dataclass(frozen=True)
class LeafView:
    """A tensor beside a viewed weight in a quantized checkpoint (`weight_scale`, `weight_packed`,
    `weight_shape`, ... of a Linear whose weight is a PartView or a JoinedView), read as that weight
    is: rows `start:stop` of `sources[0]` along `dim` (a PartView's; of `total` rows: a tensor spanning
    them is sliced, one packing rows (zero points, 8 to a value) sliced in proportion, one value kept
    as it is, a `weight_shape` told the part's rows), or the parts joined (a JoinedView's)."""

    sources: tuple[str, ...]
    dim: int
    start: int = 0
    stop: int = 0
    total: int = 0
    shape_tensor: bool = False  # compressed-tensors' `weight_shape`: the weight's shape as a tensor

    def read(self, slices: list) -> torch.Tensor:
        ts = [s[:] for s in slices]
        if len(ts) > 1:
            fix = "re-export the checkpoint with one scale for the fused parts"
            return joined(ts, self.dim, self.shape_tensor, f"{self.sources}: the parts of one Linear", fix)
        t = ts[0]
        if self.shape_tensor:
            out = t.clone()
            out[self.dim] = self.stop - self.start
            return out
        rows = t.shape[self.dim] if t.dim() > self.dim else 0
        if rows == self.total:
            return t.narrow(self.dim, self.start, self.stop - self.start).contiguous()
        if rows > 1 and self.total % rows == 0:
            pack = self.total // rows
            return t.narrow(self.dim, self.start // pack, (self.stop - self.start) // pack).contiguous()
        return t

    def shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        first = list(shapes[0])
        if self.shape_tensor or len(first) <= self.dim:
            return tuple(first)
        if len(shapes) > 1:
            if all(s[self.dim] > 1 for s in shapes) and not all(math.prod(s) == 1 for s in shapes):
                first[self.dim] = sum(s[self.dim] for s in shapes)
            return tuple(first)
        rows = first[self.dim]
        if rows == self.total:
            first[self.dim] = self.stop - self.start
        elif rows > 1 and self.total % rows == 0:
            first[self.dim] = (self.stop - self.start) // (self.total // rows)
        return tuple(first)


View = SourceView | JoinedView | PartView | LeafView


def stored_modules(views: dict[str, View]) -> dict[str, list[str]]:
    """Module name -> the module names the files store its tensors under, where a view joins or splits
    them (per-expert slices of 3-D experts keep their own names)."""
    out: dict[str, list[str]] = {}
    for name, view in views.items():
        if isinstance(view, SourceView):
            continue
        module = name.rpartition(".")[0]
        for source in view.sources:
            on_disk = source.rpartition(".")[0]
            if on_disk not in out.setdefault(module, []):
                out[module].append(on_disk)
    return out
