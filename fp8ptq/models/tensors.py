"""What a checkpoint holds for a module, from the module alone (no loader, no source): below both
`loader` / `skeleton` and `gguf`, so the GGUF completeness check needs no import back into the loader."""

from __future__ import annotations

import torch


def stored_names(module: torch.nn.Module, recurse: bool = True) -> list[str]:
    """What a checkpoint holds for a module: its parameters and persistent buffers (e.g. DeepSeek's
    router score-correction bias)."""
    names = [n for n, _ in module.named_parameters(recurse=recurse)]
    for owner_name, owner in module.named_modules() if recurse else [("", module)]:
        for b in owner._buffers:
            if b not in owner._non_persistent_buffers_set and owner._buffers[b] is not None:
                names.append(f"{owner_name}.{b}" if owner_name else b)
    return names


def layers_past(weight_map, layers: str, text_config) -> list[str]:
    """The decoder-layer prefixes (`model.layers.61`) under `layers` that the weights hold past config's
    num_hidden_layers: multi-token-prediction layers (DeepSeek-V3, GLM-4.5, MiMo: `num_nextn_predict_layers`),
    which transformers' model classes do not build and vLLM's `method: mtp` reads. An export carries them
    as stored (export/writer._rest_files) and lists them in `ignore` (runs/finish._kept_float)."""
    prefix, n = layers + ".", text_config.num_hidden_layers
    found = {name[len(prefix) :].partition(".")[0] for name in weight_map if name.startswith(prefix)}
    return [f"{prefix}{i}" for i in sorted(int(i) for i in found if i.isdigit() and int(i) >= n)]


MTP_MODULE = "mtp"  # Qwen3-Next / Qwen3.5 store their MTP block as `mtp.*` (vLLM: Qwen3NextMTP, prefix "mtp")


def mtp_prefixes(weight_map, layers: str, text_config) -> list[str]:
    """The MTP modules an export carries float, as module prefixes: each layer past num_hidden_layers
    (layers_past) and a top-level `mtp` block. They go to `ignore` (runs/finish._kept_float): vLLM builds
    them with the checkpoint's quantization config and would otherwise expect quantized Linears there."""
    found = layers_past(weight_map, layers, text_config)
    return found + ([MTP_MODULE] if any(n.startswith(MTP_MODULE + ".") for n in weight_map) else [])
