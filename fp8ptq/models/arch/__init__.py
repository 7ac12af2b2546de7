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
    """The adapter of a transformers config (or a config dict), by its model_type; for a model_type no
    adapter registers, the layout discovered from the model transformers builds (generic.py)."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    arch = ARCHS.get(model_type)
    if arch is None:
        return _discovered(config)
    return arch


_DISCOVERED: dict[str, Arch] = {}


def _discovered(config) -> Arch:
    from fp8ptq.models.arch.generic import discover

    if isinstance(config, dict):
        from transformers import AutoConfig

        rest = {k: v for k, v in config.items() if k != "model_type"}
        try:
            config = AutoConfig.for_model(config.get("model_type"), **rest)
        except (ValueError, KeyError, TypeError) as err:
            raise ModelError(
                f"unsupported architecture '{config.get('model_type')}' ({config.get('architectures')}): {err}",
                fix="`fp8ptq model-free MODEL -r fp8-dynamic -o OUT` quantizes the checkpoint by tensor names",
            ) from None
    key = config.to_json_string(use_diff=False)
    if key not in _DISCOVERED:
        if len(_DISCOVERED) > 8:
            _DISCOVERED.clear()
        _DISCOVERED[key] = discover(config)
    return _DISCOVERED[key]


from fp8ptq.models.arch import deepseek_v3, gemma3, gpt_oss, llama, mixtral, phi3, qwen3_moe  # noqa: E402,F401  (each registers its family)
