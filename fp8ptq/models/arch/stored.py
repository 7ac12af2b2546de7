"""Stored names: how a checkpoint names and lays out the tensors the generic adapter's modules hold.

transformers renames and reshapes tensors on load by its checkpoint conversion mapping: WeightRenaming
rules (legacy multimodal prefixes, `backbone.` -> `model.`) and WeightConverters (Concatenate, Chunk,
Split; experts merged into 3-D tensors). fp8ptq reads the same mapping, through transformers' own
`rename_source_key`, to name each module's tensors as the files store them and to read (and write back)
those stored joined or split through views (models/views.py).
"""

from __future__ import annotations

import re

import torch

from fp8ptq.models.arch.capture import prefix_pairs
from fp8ptq.models.moe import fused_views
from fp8ptq.models.views import JoinedView, LeafView, PartView


def renames(skeleton: torch.nn.Module, stored: list[str]) -> dict[str, str]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    rules = [t for t in get_model_conversion_mapping(skeleton) if isinstance(t, WeightRenaming)]
    meta = skeleton.state_dict()
    new = {
        name: kept(name, rename_source_key(name, rules, [], skeleton.base_model_prefix, meta)[0], meta)
        for name in stored
    }
    out = {n: old for old, n in new.items() if n != old}
    for p_new, p_old in prefix_pairs(out):  # a prefix no stored tensor under it keeps unrenamed
        if all(old != n for old, n in new.items() if n.startswith(p_new)):
            out[p_new] = p_old
    return out


def kept(stored: str, renamed: str, meta: dict) -> str:
    """The module name transformers loads the stored tensor `stored` into, given the name its rules
    rename it to: the stored name itself where the model has that name and not the renamed one. A rule
    written for a name inside the layers can also match another module's (DeepSeek-V4's `.norm.` ->
    `.kv_norm.` for the attention's norm matches the final `model.norm`); transformers' loader then keeps
    the stored name, and so must the check of what the files hold."""
    return stored if renamed not in meta and stored in meta else renamed


def source_views(names: list[str], config, skeleton: torch.nn.Module, experts: dict, leaves: tuple | None) -> dict:
    """Arch.source_views of the generic adapter: the tensors transformers' own checkpoint converters
    join or split on load (converter_views), and the experts of a checkpoint that stores them fused in
    3-D tensors as transformers holds them, each expert's Linears read from their slices
    (models/moe.fused_views)."""
    views = converter_views(names, skeleton)
    if experts:
        renamed = renames(skeleton, names)
        present = set(names)
        stored = {}
        for path in experts:
            for param in ("gate_up_proj", "up_proj", "down_proj"):
                name = f"{path}.{param}"
                on_disk = renamed.get(name, name)
                if on_disk in present:
                    stored[name] = on_disk
        views |= fused_views(stored, experts, leaves)
    return views


def converter_views(names: list[str], skeleton: torch.nn.Module) -> dict:
    """Module tensor name -> its view of the stored tensors, for transformers' checkpoint converters that
    join several stored tensors into one (Concatenate: JoinedView) or split one into several (Chunk,
    Split: PartView, its rows permuted where a PermuteForRope follows the split), matched to the stored
    names by transformers' own `rename_source_key`. Converters of other kinds (experts merged into 3-D
    tensors: models/moe.py) are not read here: a tensor only they make is reported missing by the
    config-agreement check."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming, rename_source_key

    mapping = get_model_conversion_mapping(skeleton)
    rules = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter) and _readable(t.operations)]
    if not converters:
        return {}
    meta, prefix = skeleton.state_dict(), skeleton.base_model_prefix
    joined: dict[tuple[str, int], dict[int, str]] = {}
    views: dict = {}
    for name in names:
        new, pattern = rename_source_key(name, rules, converters, prefix, meta)
        module, _, leaf = name.rpartition(".")
        if pattern is None and leaf != "weight":  # a scale beside a weight a converter matches by `.weight`
            new, pattern = rename_source_key(f"{module}.weight", rules, converters, prefix, meta)
            new = f"{new.removesuffix('.weight')}.{leaf}"
        if pattern is None or kept(name, new, meta) != new:  # transformers loads it under its stored name
            continue
        k, conv = next((k, c) for k, c in enumerate(converters) if pattern in c.source_patterns)
        if isinstance(conv.operations[0], Concatenate):
            joined.setdefault((new, k), {})[conv.source_patterns.index(pattern)] = name
        else:
            views |= _split_views(name, new, conv, meta, skeleton.config)
    for (new, k), found in joined.items():
        conv = converters[k]
        if len(found) != len(conv.source_patterns):
            continue
        parts, dim = tuple(found[i] for i in range(len(found))), conv.operations[0].dim
        if new in meta:
            views[new] = JoinedView(parts, dim)
        elif _weight_of(new) in meta:  # beside a joined weight, in a quantized checkpoint
            views[new] = LeafView(parts, dim, shape_tensor=new.endswith(".weight_shape"))
    return views


def _readable(ops: list) -> bool:
    """Whether converter_views reads a converter of these operations: one Chunk, Split or Concatenate of
    fixed parts, or a Chunk or Split of rows followed by transformers' rotary row permutation (q/k
    stored with each head's rotary pairs interleaved, as vision towers converted from other codebases)."""
    from transformers.core_model_loading import Chunk, Concatenate, PermuteForRope, Split

    first, rest = ops[0], ops[1:]
    if type(first) not in (Chunk, Concatenate, Split) or getattr(first, "num_shards_attribute", None) is not None:
        return False
    if not rest:
        return True
    permute = rest[0]
    return (
        len(rest) == 1
        and type(permute) is PermuteForRope
        and not permute.inverse
        and type(first) is not Concatenate
        and first.dim == 0
    )


def _rope_heads(conv, config) -> tuple[int, ...]:
    """Per target of a split converter, the heads whose rows the PermuteForRope after the split regroups
    (its config's num_attention_heads, read as transformers does), 0 for a target it leaves as stored."""
    if len(conv.operations) == 1:
        return ()
    op = conv.operations[1]
    sub = getattr(config, op.subconfig_key, config) if op.subconfig_key is not None else config
    heads = getattr(sub, "num_attention_heads", 1)
    names = op.permute_layer_names
    return tuple(heads if names is None or any(n in t for n in names) else 0 for t in conv.target_patterns)


def _split_views(name: str, new: str, conv, meta: dict, config) -> dict:
    """The views of the tensors a Chunk or Split converter `conv` makes of the stored tensor `name`
    (renamed `new`, its first target's name): a PartView each, and a LeafView for a quantized
    checkpoint's scale, codes or shape beside the split weight (none where the rows are permuted)."""
    dim = conv.operations[0].dim
    targets = [new.replace(conv.target_patterns[0], t, 1) for t in conv.target_patterns]
    weights = [t if t in meta else _weight_of(t) for t in targets]
    if any(w not in meta for w in weights):
        return {}
    sizes = [meta[w].shape[dim] for w in weights]
    rope = _rope_heads(conv, config)
    if any(h and s % (2 * h) for h, s in zip(rope, sizes)):  # no whole rotary pairs per head: no such layout
        return {}
    views: dict = {}
    start = 0
    for i, (t, size) in enumerate(zip(targets, sizes)):
        if t in meta:
            views[t] = PartView(name, dim, start, start + size, tuple(targets), rope, i)
        elif not rope:
            views[t] = LeafView((name,), dim, start, start + size, sum(sizes), t.endswith(".weight_shape"))
        start += size
    return views


def _weight_of(name: str) -> str:
    """The weight beside a module's tensor (`q_proj.weight_scale` -> `q_proj.weight`)."""
    return name.rpartition(".")[0] + ".weight"


def stored_tower_prefixes(model: torch.nn.Module, towers: tuple[str, ...]) -> tuple[str, ...]:
    """Ignore patterns for the tower Linears a checkpoint stores under other names than the modules'
    (MiniMax-M3-VL's `patch_merge_mlp.linear_1` for `model.multi_modal_projector.merge_linear_1`), by
    transformers' renamings reversed: the stored path up to its first part the module path lacks (the
    whole path where that part is the Linear's own name); and the LM head's stored name where it is not
    `lm_head` (the recipe's `ignore` names it so). A tower that is one Linear (Step3p7's projector) is
    named by its own path too: the towers' patterns (`name\\..*`) match only modules under a tower."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    found = {
        f"re:.*{re.escape(t.rpartition('.')[2])}$"
        for t in towers
        if isinstance(model.get_submodule(t), torch.nn.Linear)
    }
    rules = [t.reverse_transform() for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    if not rules:
        return tuple(sorted(found))
    head = rename_source_key("lm_head.weight", rules[::-1], [], None, None, reverse=True)[0]
    if head != "lm_head.weight":  # the head stored as `language_model.lm_head`: never quantized by name
        found.add(head.removesuffix(".weight"))
    for tower in towers:
        for n, m in model.get_submodule(tower).named_modules():
            if not isinstance(m, torch.nn.Linear):
                continue
            module = f"{tower}.{n}" if n else tower
            stored = rename_source_key(f"{module}.weight", rules[::-1], [], None, None, reverse=True)[0]
            parts, own = stored.removesuffix(".weight").split("."), set(module.split("."))
            new = next((i for i, p in enumerate(parts) if p not in own), None)
            if new is not None and new + 1 < len(parts):
                found.add(f"re:.*{re.escape('.'.join(parts[: new + 1]))}\\..*")
            elif new is not None:  # the Linear itself renamed: a pattern of the path to it, which has no `.` after
                found.add(f"re:.*{re.escape('.'.join(parts))}$")
    return tuple(sorted(found))
