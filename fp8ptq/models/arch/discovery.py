"""Where the generic adapter (models/arch/generic.py) finds a decoder stack's layer list and the module after
its last layer, from what the modules are rather than from transformers' usual names."""

from __future__ import annotations

import torch

from fp8ptq.models.moe import is_fused_experts

# Config attributes that count decoder layers. num_hidden_layers first: where it names one list, that list
# is the stack's. A family whose layers each hold several sublayers counts them in num_hidden_layers and
# its layer list in another (num_layers).
LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layers", "n_layer")


def layer_counts(text) -> dict[str, int]:
    """The layer-count attributes a (text) config has, in LAYER_COUNTS order."""
    return {k: v for k in LAYER_COUNTS if isinstance(v := getattr(text, k, None), int) and not isinstance(v, bool)}


def layer_lists(decoder: torch.nn.Module, text) -> tuple[list[str], str]:
    """The decoder's ModuleList children as long as the first layer-count attribute that one matches, and
    a description of the counts tried (for the message when none or several match)."""
    counts = layer_counts(text)
    lists = {n: len(m) for n, m in decoder.named_children() if isinstance(m, torch.nn.ModuleList)}
    for k, count in counts.items():
        found = [n for n, length in lists.items() if length == count]
        if found:
            return found, f"{k} {count}"
    return [], " or ".join(f"{k} {v}" for k, v in counts.items())


def final_norms(decoder: torch.nn.Module, layers: str, embed: torch.nn.Module) -> list[str]:
    """The decoder's children that can be the module after its last layer: its norms (by class name; where
    several, the one transformers names `norm`); a stack without one ends in some other module with
    weights (a mixer that reduces hyper-connection streams to the hidden state, say): its one child with
    parameters besides the layer list and the embeddings."""
    norms = [n for n, m in decoder.named_children() if "norm" in type(m).__name__.lower()]
    if len(norms) > 1 and "norm" in norms:  # transformers' name for the norm after the last layer
        return ["norm"]
    if norms:
        return norms
    return [
        n for n, m in decoder.named_children() if n != layers and m is not embed and any(True for _ in m.parameters())
    ]


def fused_modules(layers: torch.nn.ModuleList, prefix: str) -> dict[str, tuple[int, int, bool]]:
    """Every fused experts module of the stack: its path -> (expert count, intermediate size, gated)."""
    found = {}
    for i, layer in enumerate(layers):
        for n, m in layer.named_modules():
            if is_fused_experts(m):
                gated = m._parameters.get("gate_up_proj") is not None
                count, rows, _ = (m.gate_up_proj if gated else m.up_proj).shape
                found[f"{prefix}.{i}.{n}"] = (count, rows // 2 if gated else rows, gated)
    return found


def contains(name: str, stack: str) -> bool:
    return stack == name or stack.startswith(name + ".") or name.startswith(stack + ".")


def top_modules(model: torch.nn.Module):
    """The children of the model and of its base model (`model.vision_tower`, `model.language_model`)."""
    for n, m in model.named_children():
        if n == "model" or (hasattr(model, "base_model_prefix") and n == model.base_model_prefix):
            for c, cm in m.named_children():
                yield f"{n}.{c}", cm
        else:
            yield n, m
