"""recipe.yaml and the manifest's record of a recipe: its dump, less the keys added after recipes were first
written when they hold their defaults, so outputs of recipes that do not use them stay byte-identical."""

from __future__ import annotations

import yaml

from fp8ptq.recipe import Recipe

# Keys added after recipes were first written, left out of recipe.yaml at their default so that recipes not
# using them are written (and outputs hash) as before the keys existed.
_WRITTEN_ONLY_IF_SET = {
    ("transforms",): [],
    ("calibration", "kv_observer"): "minmax",
    ("scheme", "lm_head"): None,
    ("smooth", "method"): "smoothquant",
    **{("calibration", k): v for k, v in (("rounding", "nearest"), ("rounding_iters", 200), ("rounding_lr", 0.005))},
    ("calibration", "gptq_float_target"): 0.0,
}
# the manifest's record kept kv_observer and transforms from the start
_RECORDED_ONLY_IF_SET = {k: v for k, v in _WRITTEN_ONLY_IF_SET.items() if k[-1] not in ("kv_observer", "transforms")}


def _drop_defaults(data: dict, table: dict) -> dict:
    for (*path, key), default in table.items():
        section = data
        for p in path:
            section = section[p] if section is not None else None
        if section is not None and section[key] == default:
            del section[key]
    return data


def recipe_record(recipe: Recipe) -> dict:
    """The recipe as the manifest records it: its dump, without keys newer than the record that are unset
    (a quantized LM head), so the manifests of runs that do not use them stay what they were."""
    return _drop_defaults(recipe.model_dump(mode="json"), _RECORDED_ONLY_IF_SET)


def recipe_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(_drop_defaults(recipe.model_dump(mode="json"), _WRITTEN_ONLY_IF_SET), sort_keys=False)
