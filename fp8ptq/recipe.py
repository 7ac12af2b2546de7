"""Recipes: user-facing quantization configuration (pydantic v2, frozen, unknown keys are errors)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from compressed_tensors.quantization import QuantizationArgs, QuantizationStrategy, QuantizationType
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from fp8ptq.errors import RecipeError
from fp8ptq.io import load_yaml
from fp8ptq.quantization.plan import check_pattern
from fp8ptq.quantization.schemes import LinearScheme, calibrated_inputs, handler
from fp8ptq.quantization.schemes.pairing import check_linear_scheme

BUILTIN_DIR = Path(__file__).parent / "recipes"


class _Frozen(BaseModel):
    # allow_inf_nan=False: a NaN or inf in any recipe number is refused at load, naming the field
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# The QuantizationArgs keys a recipe may set, in the order recipes are written back (recipe.yaml).
ARG_KEYS = ("num_bits", "type", "strategy", "group_size", "symmetric", "dynamic")
OPTIONAL_ARG_KEYS = ("block_structure", "scale_dtype")  # written only when set


class QuantArgs(QuantizationArgs):
    """One tensor's quantization: compressed-tensors' own QuantizationArgs (so scheme handlers, export
    and the evaluator see one type), restricted to the keys fp8ptq reads, with fp8ptq's defaults (FP8,
    per tensor), and frozen once validated. What a combination means is the scheme handlers' to check
    (quantization/schemes/), called by `Scheme`."""

    model_config = ConfigDict(extra="forbid")
    type: QuantizationType = QuantizationType.FLOAT
    strategy: QuantizationStrategy | None = QuantizationStrategy.TENSOR
    _sealed: bool = PrivateAttr(default=False)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data):
        if isinstance(data, dict):
            unknown = sorted(set(data) - set(ARG_KEYS) - set(OPTIONAL_ARG_KEYS))
            if unknown:
                raise ValueError(
                    f"unknown key '{unknown[0]}' (valid keys there: {', '.join(ARG_KEYS + OPTIONAL_ARG_KEYS)})"
                )
            kind, bits = str(data.get("type", "float")).lower(), data.get("num_bits", 8)
            valid = {"float": (4, 8), "int": tuple(range(2, 9))}.get(kind)
            if valid is None:
                raise ValueError(f"type '{data.get('type')}' is not a quantization type (use float or int)")
            if not isinstance(bits, int) or bits not in valid:
                raise ValueError(f"num_bits {bits!r} is not a {kind} width fp8ptq knows ({', '.join(map(str, valid))})")
        return data

    @model_validator(mode="after")
    def _seal(self):
        self._sealed = True
        return self

    def __setattr__(self, name, value):
        if self.__pydantic_private__ and self.__pydantic_private__.get("_sealed"):
            raise TypeError(f"recipe arguments are frozen: cannot set '{name}'")
        super().__setattr__(name, value)

    @model_serializer(mode="plain")
    def _dump(self) -> dict:
        out = {k: getattr(self, k) for k in ARG_KEYS}
        out.update({k: getattr(self, k) for k in OPTIONAL_ARG_KEYS if getattr(self, k) is not None})
        if "scale_dtype" in out:  # a torch dtype: written as its name (`uint8`), which compressed-tensors parses
            out["scale_dtype"] = str(out["scale_dtype"]).removeprefix("torch.")
        return out

    def ct(self) -> QuantizationArgs:
        """A plain compressed-tensors copy, for compressed-tensors' own objects (which re-validate and
        so would write into this frozen one)."""
        return QuantizationArgs.model_validate(self._dump())

    def describe(self) -> str:
        kind = ("FP" if self.type == "float" else "INT") + str(self.num_bits)
        group = f" g{self.group_size}" if self.group_size else ""
        return f"{kind} per-{self.strategy}{group}" + ("" if self.symmetric else " asym")


class Head(_Frozen):
    """The LM head, quantized at export (round to nearest with its weights' grid; `--quantize-lm-head`
    derives it from the scheme: runs/overrides.head_from). Its inputs are not calibrated: dynamic or none. vLLM 0.32
    quantizes a ParallelLMHead with any Linear scheme a name target picks (compressed_tensors.py
    `get_quant_method`); a tied head is written untied (the embedding stays as stored)."""

    weights: QuantArgs
    input_activations: QuantArgs | None = None

    @model_validator(mode="after")
    def _check(self):
        check_linear_scheme(self.weights, self.input_activations, "lm_head")
        if calibrated_inputs(self.input_activations):
            raise ValueError(
                "lm_head.input_activations: the LM head's inputs are not calibrated; use dynamic ones "
                "({strategy: token, dynamic: true}) or none"
            )
        return self


class Scheme(_Frozen):
    """What gets quantized and how. `targets`/`ignore`: exact names, `re:` patterns or class names."""

    weights: QuantArgs
    input_activations: QuantArgs | None = None
    kv_cache: QuantArgs | None = None
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ("lm_head",)
    lm_head: Head | None = None  # a quantized LM head (its own config group; `lm_head` leaves `ignore`)

    @model_validator(mode="after")
    def _check(self):
        w, a, kv = self.weights, self.input_activations, self.kv_cache
        check_linear_scheme(w, a)
        if kv is not None:
            if kv.scale_dtype is not None:
                raise ValueError("kv_cache: scale_dtype is only for MX float groups (MXFP4 / MXFP8 weights: uint8)")
            handler(kv).check_kv(kv, "kv_cache")
        for field in ("targets", "ignore"):  # compressed-tensors and vLLM compile these with `re`
            for pattern in getattr(self, field):
                if pattern.startswith("re:"):
                    check_pattern(pattern, field)
        return self


Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class Smooth(_Frozen):
    """SmoothQuant: per-channel scales s folded into the RMSNorm before q/k/v and gate/up (x/s, W·s).
    Exact in fp32; moves activation outliers into the weights. alpha 'auto' picks, per layer and per
    group, the alpha in `alphas` with the smallest measured quantized-output error; no smoothing is
    always a candidate, so a group is only smoothed where it measurably helps.
    method: smoothquant (s from the channels' max |x| and max |W|) or awq (activation-aware weight
    scaling: s from their mean magnitudes, as AWQ; for weight-only recipes too, where the error is the
    weights' alone)."""

    method: Literal["smoothquant", "awq"] = "smoothquant"
    alpha: Fraction | Literal["auto"] = "auto"
    alphas: tuple[Fraction, ...] = Field((0.2, 0.35, 0.5, 0.65, 0.8, 0.95), min_length=1)
    groups: tuple[Literal["qkv", "gate_up", "down"], ...] = ("qkv", "gate_up")  # down: into up_proj's rows


class Flatten(_Frozen):
    """FlattenQuant on the down_proj input: split each layer's largest intermediate channels k ways
    (exact), so a per-tensor activation scale shrinks. `extra_channels` per layer, rounded up so that
    intermediate_size is a multiple of `multiple` x `tp` (tensor-parallel serving keeps working)."""

    # each extra channel is a copied column of down_proj in every layer: 65536 is several times any width
    extra_channels: int = Field(128, ge=1, le=65536)
    tp: int = Field(1, ge=1, le=1024)
    multiple: int = Field(128, ge=1, le=65536)


class Mixed(_Frozen):
    """Per-Linear 4/8-bit mix: the `weights`/`input_activations` here are the low-bit alternative; the
    least sensitive fused groups move to it until `int4_fraction` of the linear FLOPs is low-bit."""

    weights: QuantArgs
    input_activations: QuantArgs | None = None
    int4_fraction: float = 0.5
    sensitivity: Literal["output", "kl"] = "output"

    @model_validator(mode="after")
    def _check(self):
        handler(self.weights).check_weights(self.weights, "mixed.weights")
        if not 0.0 <= self.int4_fraction <= 1.0:
            raise ValueError(f"mixed.int4_fraction must be in [0, 1], got {self.int4_fraction}")
        if self.input_activations is not None:
            raise ValueError("mixed: the low-bit alternative is weight-only (W4A16): set input_activations to null")
        return self


class Calibration(_Frozen):
    """How scales are chosen. Only used when the scheme needs data (static activations, KV, GPTQ)."""

    observer: Literal["minmax", "mse"] = "minmax"  # static activation scales
    # KV-cache scales (mse: the clip ratio minimising the FP8 reconstruction error; constant: 1.0, vLLM's without)
    kv_observer: Literal["minmax", "mse", "constant"] = "minmax"
    # weight scales (mse: per-group / per-block clip search; integer, FP4 and FP8 block weights)
    # hessian_mse: with GPTQ's static groups on integer/FP4 grids, that search's error weighted per input
    # column by the Hessian diagonal; elsewhere the same as mse
    weight_observer: Literal["minmax", "mse", "hessian_mse"] = "minmax"
    weight_method: Literal["rtn", "gptq"] = "rtn"
    # signround: after RTN or GPTQ, each residual block's rounding trained on its output error by signed
    # gradient descent (calibrate/signround.py): rounding_iters steps, lr falling linearly from rounding_lr
    rounding: Literal["nearest", "signround"] = "nearest"
    rounding_iters: int = Field(200, ge=1, le=100000)
    rounding_lr: float = Field(0.005, gt=0.0, le=1.0)
    # INT8 weights in 7-bit codes [-64, 63], stored as INT8: CPU INT8 GEMMs without VNNI saturate past 64
    weight_code_bits: Literal[7] | None = None
    num_samples: int = Field(64, ge=1, le=1 << 20)
    seq_len: int = Field(512, ge=8, le=1 << 20)
    seed: int = Field(0, ge=0, le=2**63 - 1)  # torch's generators take 64-bit seeds
    gptq_damp: float = Field(0.01, gt=0.0, le=1.0)  # a fraction of the Hessian's mean diagonal
    gptq_block_size: int = Field(128, ge=1, le=65536)
    gptq_act_order: bool = False
    # 4-bit integer group scales as stored (bf16, what vLLM's W4A16 kernels load) or, "fp8", moved onto
    # the per-row FP8 grid vLLM's Hopper W4A8 kernel re-quantizes them to (ops.intq.fp8_row_group_scales),
    # so that kernel computes exactly the simulated weights. Required by W4A8-FP8 schemes.
    group_scales: Literal["bf16", "fp8"] = "bf16"
    # GPTQ Hessian from the quantized inputs the engine sees (one more pass per static group)
    gptq_quantized_inputs: bool = False
    # GPTQ towards the float model's output (GPTAQ, calibrate/gptaq.py): each group's weights first move this
    # fraction of the way to the least-squares map from the quantized model's inputs to it; 0: plain GPTQ
    gptq_float_target: float = Field(0.0, ge=0.0, le=1.0)
    # MoE: an expert routed fewer (token, expert) pairs is calibrated on every token (calibrate/experts.py)
    moe_min_tokens: int = Field(64, ge=0)

    @property
    def weight_search(self) -> tuple[bool, bool]:
        """(search the weight scales, weight that search by diag(H)) from weight_observer."""
        return self.weight_observer != "minmax", self.weight_observer == "hessian_mse"


class Recipe(_Frozen):
    name: str
    description: str = ""
    scheme: Scheme
    calibration: Calibration = Calibration()
    smooth: Smooth | None = None
    flatten: Flatten | None = None
    mixed: Mixed | None = None
    # exact float transforms before calibration; rotate: QuaRot/SpinQuant R1 + R2 (outliers/rotate.py)
    transforms: tuple[Literal["rotate"], ...] = ()
    # quality gates (fp8ptq.gates syntax), held on both real models; `--gate` adds, `--no-recipe-gates` drops
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

    def linear_scheme(self) -> LinearScheme:
        """The scheme of every quantized Linear (a mixed recipe's high-bit one)."""
        return LinearScheme(self.scheme.weights, self.scheme.input_activations)

    def low_scheme(self) -> LinearScheme | None:
        """A mixed recipe's low-bit scheme; None otherwise."""
        return None if self.mixed is None else LinearScheme(self.mixed.weights, self.mixed.input_activations)

    @model_validator(mode="after")
    def _check_combination(self):
        if self.mixed is not None and self.scheme.weights.num_bits != 8:
            raise ValueError("mixed: the main scheme is the 8-bit one; its weights must be 8-bit")
        if self.flatten is not None and self.scheme.input_activations is None:
            raise ValueError("flatten shrinks activation scales: it needs input_activations")
        if self.smooth is not None and self.smooth.method == "smoothquant" and self.scheme.input_activations is None:
            raise ValueError(
                "smooth (SmoothQuant) migrates activation outliers into weights: it needs input_activations "
                "(weight-only recipes: smooth.method awq)"
            )
        if self.calibration.gptq_float_target > 0 and self.calibration.weight_method != "gptq":
            raise ValueError(
                "calibration.gptq_float_target moves GPTQ's target: it needs weight_method gptq (or set it to 0)"
            )
        kv = self.scheme.kv_cache
        if kv is not None and kv.strategy == "attn_head" and self.calibration.kv_observer != "minmax":
            raise ValueError("calibration.kv_observer: per-head KV scales (strategy attn_head) take minmax")
        w, a = self.scheme.weights, self.scheme.input_activations
        # the weight search of a mixed recipe is its 4-bit part's, not the 8-bit main scheme's
        handler(w).check_calibration(w, a, self.calibration, searched=self.mixed is None)
        return self

    @classmethod
    def builtin(cls, name: str) -> Recipe:
        """A built-in recipe by name (`fp8ptq recipes list`)."""
        if name not in builtin_names():
            raise RecipeError(f"unknown recipe '{name}'", fix=f"use one of {', '.join(builtin_names())}")
        return load_recipe(name)

    def set(self, key: str, value) -> Recipe:
        """A copy with one dotted key changed (`recipe.set("calibration.gptq_damp", 0.02)`): what `--set
        KEY=VALUE` does with the value as a Python object, validated with the messages a YAML file gets."""
        data = self.model_dump(mode="json")
        set_dotted(data, str(key), value, f"'{key}'", ".set('{}', VALUE)")
        return parse_recipe(data, f"'{self.name}' with {key}")

    @property
    def needs_data(self) -> bool:
        a = self.scheme.input_activations
        static_acts = calibrated_inputs(a)
        return (
            static_acts
            or self.scheme.kv_cache is not None
            or self.calibration.weight_method == "gptq"
            or self.calibration.rounding != "nearest"
            or self.smooth is not None
            or self.flatten is not None
            or self.mixed is not None
        )


def set_dotted(data: dict, key: str, value, where: str, whole: str) -> None:
    """Set the dotted `key` of a recipe's data in place, starting a section left out (null); `where` and `whole`
    ('{}': a key) word the refusals."""
    parts = key.split(".")
    if not all(parts):
        raise RecipeError(f"{where} is not a dotted recipe key", fix="e.g. calibration.gptq_damp or smooth.alpha")
    node = data
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            sec = ".".join(parts[: i + 1])
            raise RecipeError(f"{where}: '{sec}' is a value, not a section", fix="set it whole: " + whole.format(sec))
    node[parts[-1]] = value


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def _format_validation(source: str, err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key '{loc}'")
        elif e["type"] == "value_error":  # our own message, without pydantic's "Value error, " prefix
            parts.append(f"{loc}: {e['ctx']['error']}")
        else:
            parts.append(f"{loc}: {e['msg']}")
    return f"recipe {source}: " + "; ".join(parts)


def _valid_keys_hint(err: ValidationError) -> str:
    """For unknown keys, list the valid keys of the model where the unknown key sits."""
    models = {(): Recipe, ("scheme",): Scheme, ("calibration",): Calibration, ("smooth",): Smooth}
    models |= {("flatten",): Flatten, ("mixed",): Mixed, ("mixed", "weights"): QuantArgs}
    for sub in ("weights", "input_activations", "kv_cache"):
        models[("scheme", sub)] = QuantArgs
    for e in err.errors():
        if e["type"] == "extra_forbidden":
            model = models.get(tuple(str(x) for x in e["loc"][:-1]))
            if model is not None:
                return "valid keys there: " + ", ".join(ARG_KEYS if model is QuantArgs else model.model_fields)
    return "see `fp8ptq recipes show fp8-kv8` for a valid recipe"


def parse_recipe(data: object, source: str) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {source}: expected a YAML mapping, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_validation(source, err), fix=_valid_keys_hint(err)) from None


MAX_RECIPE_BYTES = 1 << 20


def load_recipe(name_or_path: str | Path | dict | Recipe) -> Recipe:
    """A built-in recipe by name (e.g. 'fp8-kv8'), a YAML file path, a mapping shaped like the YAML, or a
    Recipe (returned as it is: validated when it was made)."""
    if isinstance(name_or_path, Recipe):
        return name_or_path
    if isinstance(name_or_path, dict):
        return parse_recipe(name_or_path, "(a mapping)")
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
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"recipe file '{path}' is {path.stat().st_size:,} bytes", fix="a recipe is a few lines")
    try:
        data = load_yaml(path.read_text())
    except (yaml.YAMLError, ValueError) as err:
        raise RecipeError(f"recipe file '{path}' is not valid YAML: {err}") from None
    return parse_recipe(data, str(path))
