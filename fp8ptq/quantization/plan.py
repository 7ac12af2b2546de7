"""Which modules a rule applies to, and how fused shards are grouped. One function decides matching
for calibration, analysis, export and evaluation: compressed-tensors' own `is_match` (exact name,
`re:` full match, class name; ignore wins), so our notion of a target is vLLM's. Which shards vLLM
fuses, and which modules are never quantized, the architecture adapter says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from compressed_tensors.utils.match import is_match

from fp8ptq.errors import RecipeError
from fp8ptq.io import time_limit
from fp8ptq.models.arch import Arch

# why a Linear is left float by the generic path (runs/finish.py writes these into `ignore` by name)
UNCALLED = "never called as a module (the layer reads its weight directly): kept float, in ignore"


def matches(name: str, module: torch.nn.Module, targets, ignore) -> bool:
    return is_match(name, module, list(targets), list(ignore))


# module-name-like strings a pattern is tried on before any model is read: real names, long repeats of
# their parts, and the runs that make nested quantifiers backtrack (each try bounded by a timeout)
_PROBES = ("model.layers.0.self_attn.q_proj", "model.layers.17.mlp.experts.127.down_proj", "a" * 40 + "!")
_PROBES += ("model.layers." * 6 + "!", "." * 40 + "!", "0" * 40 + "!", "_" * 40 + "!")


def check_pattern(pattern: str, where: str) -> None:
    """ValueError unless a `re:` target/ignore pattern compiles and matches in bounded time: compressed-
    tensors and vLLM run it on every module name with Python's backtracking `re`, so a pattern with nested
    quantifiers in a shared recipe could hold a run for minutes. Tried on _PROBES within 0.2 s."""
    import re

    body = pattern[3:]
    if len(body) > 2000:
        raise ValueError(f"{where}: '{pattern[:60]}...' is {len(body)} characters long (a target pattern is short)")
    try:
        compiled = re.compile(body)
    except re.error as err:
        raise ValueError(f"{where}: '{pattern}' is not a valid regular expression ({err})") from None
    try:
        with time_limit(0.2):
            for probe in _PROBES:
                compiled.fullmatch(probe)
    except TimeoutError:
        raise ValueError(
            f"{where}: '{pattern}' backtracks without bound (over 0.2 s on names of 40 characters); rewrite it "
            "without nested repetition such as (a+)+"
        ) from None


@dataclass(frozen=True)
class LayerPlan:
    """Targeted Linears of one decoder layer, grouped by shared input. Names are relative to the layer."""

    prefix: str  # e.g. "model.layers.3."
    groups: tuple[tuple[str, ...], ...]
    skipped: tuple[tuple[str, str], ...]  # (relative name, why)

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(n for g in self.groups for n in g)


def _why_skipped(name: str, module, targets, arch: Arch) -> str:
    if arch.keep_float and matches(name, module, arch.keep_float, ()):
        return f"never quantized ({arch.described.removeprefix('the ')})"
    return "matched by ignore" if matches(name, module, targets, ()) else "not targeted"


def plan_layer(layer: torch.nn.Module, prefix: str, targets, ignore, arch: Arch) -> LayerPlan:
    """The targeted Linears of a decoder layer in fused groups (vLLM's shards, per the adapter)."""
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    ignore = (*ignore, *arch.keep_float)
    chosen = [n for n, m in linears.items() if matches(prefix + n, m, targets, ignore)]
    skipped = tuple((n, _why_skipped(prefix + n, m, targets, arch)) for n, m in linears.items() if n not in chosen)
    groups: list[tuple[str, ...]] = []
    taken: set[str] = set()
    traced = arch.shared_inputs(layer, prefix)
    for shared in traced or ():  # discovered: the chosen Linears that read one input share its scales
        names = [n for n in shared if n in chosen]
        if names:
            groups.append(tuple(names))
            taken.update(names)
    if traced is not None:  # a Linear the trace never saw called: its weight is read directly (Jamba's dt_proj)
        uncalled = [n for n in chosen if n not in taken]
        chosen = [n for n in chosen if n in taken]
        skipped += tuple((n, UNCALLED) for n in uncalled)
    for shards in arch.fused.values():
        by_parent: dict[str, list[str]] = {}
        for n in chosen:
            parent, _, leaf = n.rpartition(".")
            if leaf in shards:
                by_parent.setdefault(parent, []).append(n)
        for names in by_parent.values():
            leaves = {n.rpartition(".")[2] for n in names}
            if leaves != set(shards):
                raise RecipeError(
                    f"{prefix}: only {sorted(leaves)} of the fused shards {list(shards)} are targeted; "
                    "vLLM runs them as one GEMM",
                    fix="target or ignore all shards of a fused module together",
                )
            groups.append(tuple(sorted(names, key=lambda n: shards.index(n.rpartition(".")[2]))))
            taken.update(names)
    groups.extend((n,) for n in chosen if n not in taken)
    return LayerPlan(prefix=prefix, groups=tuple(groups), skipped=skipped)
