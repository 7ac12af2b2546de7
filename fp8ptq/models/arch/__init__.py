"""Architecture adapters, one small file per family, registered by model_type.

`arch_for(config)` is the only way the rest of fp8ptq learns a model's layout; an unregistered
model_type is a typed error that lists the registered ones. Adding a family: a new file here that
builds an `Arch` and calls `register`, plus its import below (docs/DESIGN.md, "How to add a family").
"""

from __future__ import annotations

from fp8ptq.errors import ModelError
from fp8ptq.models.arch.base import Arch, Block, FlattenTarget, SmoothGroup  # noqa: F401

ARCHS: dict[str, Arch] = {}


def register(arch: Arch) -> Arch:
    for t in arch.model_types:
        assert t not in ARCHS, f"model_type {t} registered twice"
        ARCHS[t] = arch
    return arch


def registered() -> list[str]:
    return sorted(ARCHS)


def arch_for(config) -> Arch:
    """The adapter of a transformers config (or a config dict), by its model_type."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    arch = ARCHS.get(model_type)
    if arch is None:
        archs = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
        raise ModelError(
            f"unsupported architecture '{model_type}' ({archs})",
            fix=f"fp8ptq calibrates the types {', '.join(registered())}; for any other, `fp8ptq model-free MODEL "
            "-r fp8-dynamic -o OUT` quantizes the checkpoint by tensor names, without data",
        )
    return arch


from fp8ptq.models.arch import deepseek_v3, gemma3, gpt_oss, llama, mixtral, phi3, qwen3_moe  # noqa: E402,F401  (each registers its family)
