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
