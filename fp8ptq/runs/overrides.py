"""What the quantize command changes in its recipe: the calibration sizes, the alias flags (--weights,
--smooth-alpha, --group-size, --block-size, --int4-fraction, --tp, --rotate, --quantize-lm-head) and the
generic `--set section.key=value`, validated together like a recipe file."""

from __future__ import annotations

import yaml

from fp8ptq.errors import RecipeError
from fp8ptq.io import load_yaml
from fp8ptq.recipe import Recipe, Scheme, builtin_names, load_recipe, parse_recipe, set_dotted
from fp8ptq.runs.config import QuantizeConfig

WEIGHT_METHODS = ("rtn", "gptq")
HEAD_8BIT = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}


def head_from(scheme: Scheme) -> dict:
    """The LM head a scheme implies (`--quantize-lm-head`), weight-only: 8-bit schemes get INT8 per
    output channel (SmolLM2's head, fp8-kv8 body: KL 0.0337 against 0.0325 with a float head, where FP8
    per-channel weights gave 0.0641 and with dynamic FP8 inputs 0.0707: a vocabulary's rows span more
    range than E4M3's 3 mantissa bits keep; BENCHMARKS.md), 4-bit ones their own weights. Any other head
    is a recipe's `scheme.lm_head`."""
    w = HEAD_8BIT if scheme.weights.num_bits == 8 else scheme.weights.model_dump()
    return {"weights": dict(w), "input_activations": None}


def recipe_overrides(cfg: QuantizeConfig, recipe: Recipe) -> Recipe:
    """The recipe as this command runs it: --num-samples / --seq-len / --seed, then the flags that change
    one of its keys (each a named alias with its own check and message), then every --set KEY=VALUE in
    order; the result is validated like the YAML, so a bad value names its key."""
    data = recipe.model_dump(mode="json")
    for key, value in (("num_samples", cfg.num_samples), ("seq_len", cfg.seq_len), ("seed", cfg.seed)):
        if value is not None:
            data["calibration"][key] = value
    if cfg.weights is not None:
        if cfg.weights not in WEIGHT_METHODS:
            raise RecipeError(
                f"--weights '{cfg.weights}' is not one of {', '.join(WEIGHT_METHODS)} "
                f"(recipe '{recipe.name}' uses {recipe.calibration.weight_method})",
                fix="use --weights rtn (round to nearest: fastest) or --weights gptq (lower error)",
            )
        data["calibration"]["weight_method"] = cfg.weights
        if cfg.weights == "rtn":  # GPTQ's float target goes with GPTQ
            data["calibration"]["gptq_float_target"] = 0.0
    if cfg.smooth_alpha is not None:
        data["smooth"] = _smooth_alpha(cfg.smooth_alpha, recipe, data.get("smooth"))
    if cfg.rotate and "rotate" not in data["transforms"]:
        data["transforms"] = [*data["transforms"], "rotate"]
    if cfg.quantize_lm_head and data["scheme"].get("lm_head") is None:
        data["scheme"]["lm_head"] = head_from(recipe.scheme)
    for value, section, key, flag in (
        (cfg.int4_fraction, "mixed", "int4_fraction", "--int4-fraction"),
        (cfg.tp, "flatten", "tp", "--tp"),
    ):
        if value is None:
            continue
        if data.get(section) is None:
            raise RecipeError(
                f"{flag} needs a recipe with a '{section}' section; '{recipe.name}' has none",
                fix=f"drop {flag} or use {such_as(lambda r, s=section: getattr(r, s) is not None)}",
            )
        data[section][key] = value
    if cfg.group_size is not None:
        w = data["scheme"]["weights"]
        if w.get("strategy") != "group":
            has = lambda r: takes(r, "scheme.weights.group_size", cfg.group_size)  # noqa: E731
            raise RecipeError(
                f"--group-size needs a recipe with group weights; '{recipe.name}' has {w.get('strategy')} weights",
                fix=f"drop --group-size or use {such_as(has)}",
            )
        w["group_size"] = cfg.group_size
    if cfg.block_size is not None:
        w, a = data["scheme"]["weights"], data["scheme"]["input_activations"]
        if w.get("strategy") != "block":
            raise RecipeError(
                f"--block-size needs a recipe with block weights; '{recipe.name}' has {w.get('strategy')} weights",
                fix=f"drop --block-size or use {such_as(lambda r: r.scheme.weights.strategy == 'block')}",
            )
        w["block_structure"] = [cfg.block_size, cfg.block_size]
        if a is not None and a.get("strategy") == "group":
            a["group_size"] = cfg.block_size
    for item in cfg.sets:
        set_key(data, item)
    return parse_recipe(data, f"{recipe.name} with command-line overrides")


def such_as(has, most: int = 3) -> str:
    """'the recipe X' / 'a recipe such as X, Y or Z': the built-in recipes for which has(recipe) holds,
    found in the recipe files (a new recipe is named without an edit here)."""
    names = [n for n in builtin_names() if has(load_recipe(n))][:most]
    if len(names) <= 1:
        return f"the recipe {names[0]}" if names else "a recipe YAML that has it"
    return "a recipe such as " + ", ".join(names[:-1]) + f" or {names[-1]}"


def takes(recipe: Recipe, key: str, value) -> bool:
    """Whether `recipe` validates with KEY (dotted, on a section it has) set to VALUE."""
    data = recipe.model_dump(mode="json")
    node = data
    for part in key.split(".")[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or key.split(".")[-1] not in node:
        return False
    node[key.split(".")[-1]] = value
    try:
        parse_recipe(data, "probe")
    except RecipeError:
        return False
    return True


def _smooth_alpha(value: str, recipe: Recipe, smooth: dict | None) -> dict:
    """--smooth-alpha: 'auto' (the recipe's measured search) or one alpha for every layer (no search)."""
    if smooth is None:
        raise RecipeError(
            f"--smooth-alpha needs a recipe with a 'smooth' section; '{recipe.name}' has none",
            fix=f"drop --smooth-alpha or use {such_as(lambda r: r.smooth is not None)}",
        )
    if value != "auto":
        try:
            alpha = float(value)
        except ValueError:
            alpha = float("nan")
        if not 0.0 <= alpha <= 1.0:
            raise RecipeError(
                f"--smooth-alpha '{value}' is neither 'auto' nor a number in [0, 1] "
                f"(recipe '{recipe.name}' uses {recipe.smooth.alpha})",
                fix="use --smooth-alpha auto (search per layer) or a fixed alpha such as --smooth-alpha 0.8",
            )
        value = alpha
    return smooth | {"alpha": value}


def set_key(data: dict, item: str) -> None:
    """Apply one `--set a.b.c=VALUE` to a recipe's data in place: VALUE is read as YAML (0.05, true, null,
    [64, 64], rtn); a section the recipe leaves out (null) is started. The recipe's own validation judges
    the result."""
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise RecipeError(
            f"--set '{item}' is not KEY=VALUE with a dotted recipe key",
            fix="e.g. --set calibration.gptq_damp=0.05 or --set smooth.alpha=0.8 (keys: fp8ptq recipes show NAME)",
        )
    try:
        value = load_yaml(raw)
    except ValueError as err:
        raise RecipeError(f"--set {key}: '{raw[:80]}' {err}", fix="write a plain value") from None
    except yaml.YAMLError as err:
        why = getattr(err, "problem", None) or err
        raise RecipeError(f"--set {key}: '{raw}' is not a YAML value ({why})", fix="quote it or close it") from None
    set_dotted(data, key.strip(), value, f"--set {key}", "--set {}=VALUE")
