"""Recipes: user-facing quantization configuration (pydantic v2, frozen, unknown keys are errors)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from fp8ptq.errors import RecipeError

BUILTIN_DIR = Path(__file__).parent / "recipes"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class QuantArgs(_Frozen):
    """One tensor's quantization, in compressed-tensors' vocabulary (see its QuantizationArgs)."""

    num_bits: Literal[8] = 8
    type: Literal["float"] = "float"
    strategy: Literal["tensor", "channel", "token"] = "tensor"
    symmetric: Literal[True] = True
    dynamic: bool = False


class Scheme(_Frozen):
    """What gets quantized and how. `targets`/`ignore`: exact names, `re:` patterns or class names."""

    weights: QuantArgs
    input_activations: QuantArgs | None = None
    kv_cache: QuantArgs | None = None
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)

    @model_validator(mode="after")
    def _check(self):
        if self.weights.dynamic or self.weights.strategy == "token":
            raise ValueError("weights: strategy must be 'tensor' or 'channel' and dynamic false")
        a = self.input_activations
        if a is not None and not ((a.strategy == "tensor" and not a.dynamic) or (a.strategy == "token" and a.dynamic)):
            raise ValueError(
                "input_activations: use {strategy: tensor, dynamic: false} (static) "
                "or {strategy: token, dynamic: true} (dynamic per token)"
            )
        kv = self.kv_cache
        if kv is not None and (kv.strategy != "tensor" or kv.dynamic):
            raise ValueError("kv_cache: only {strategy: tensor, dynamic: false} (per-tensor k/v scales) is supported")
        return self


class Calibration(_Frozen):
    """How scales are chosen. Only used when the scheme needs data (static activations, KV, GPTQ)."""

    observer: Literal["minmax", "mse"] = "minmax"
    weight_method: Literal["rtn", "gptq"] = "rtn"
    num_samples: int = 64
    seq_len: int = 512
    seed: int = 0
    gptq_damp: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = False
    gptq_quantized_inputs: bool = True  # GPTQ Hessian from the inputs the engine really sees (quantized)

    @model_validator(mode="after")
    def _check(self):
        if self.num_samples < 1 or self.seq_len < 8:
            raise ValueError("num_samples must be >= 1 and seq_len >= 8")
        return self


class Recipe(_Frozen):
    name: str
    description: str = ""
    scheme: Scheme
    calibration: Calibration = Calibration()
    # Default quality gates (fp8ptq.gates syntax), tuned for the demo model; `--gate` adds, `--no-recipe-gates` drops.
    gates: tuple[str, ...] = ()

    @field_validator("gates")
    @classmethod
    def _check_gates(cls, gates):
        from fp8ptq.gates import parse_gate

        for g in gates:
            try:
                parse_gate(g)
            except RecipeError as err:
                raise ValueError(str(err)) from None
        return gates

    @property
    def needs_data(self) -> bool:
        a = self.scheme.input_activations
        static_acts = a is not None and not a.dynamic
        return static_acts or self.scheme.kv_cache is not None or self.calibration.weight_method == "gptq"


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def _format_validation(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key '{loc}'")
        else:
            parts.append(f"{loc}: {e['msg']}")
    return f"recipe {source}: " + "; ".join(parts)


def _valid_keys_hint(err: ValidationError) -> str:
    """For unknown keys, list the valid keys of the model where the unknown key sits."""
    models = {(): Recipe, ("scheme",): Scheme, ("calibration",): Calibration}
    for sub in ("weights", "input_activations", "kv_cache"):
        models[("scheme", sub)] = QuantArgs
    for e in err.errors():
        if e["type"] == "extra_forbidden":
            model = models.get(tuple(str(x) for x in e["loc"][:-1]))
            if model is not None:
                return "valid keys there: " + ", ".join(model.model_fields)
    return "see `fp8ptq recipes show fp8-kv8` for a valid recipe"


def parse_recipe(data: object, source: str) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {source}: expected a YAML mapping, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_validation(source, err), fix=_valid_keys_hint(err)) from None


def load_recipe(name_or_path: str) -> Recipe:
    """A built-in recipe by name (e.g. 'fp8-kv8') or a YAML file path."""
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = BUILTIN_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise RecipeError(
                f"unknown recipe '{name_or_path}'",
                fix=f"use one of {', '.join(builtin_names())} or a path to a .yaml file",
            )
    if not path.is_file():
        raise RecipeError(f"recipe file '{path}' does not exist", fix="check the path")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"recipe file '{path}' is not valid YAML: {err}") from None
    return parse_recipe(data, str(path))


def recipe_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
