"""The quantize command as one typed value (no torch here: `import fp8ptq.api` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8ptq import data as data_mod
from fp8ptq.draft.auto import DRAFT_TIME_BUDGET_S, DraftBundleConfig
from fp8ptq.errors import RecipeError

# --draft value -> draft.auto.DraftBundleConfig's kind ("none": no draft)
DRAFT_KINDS = {"auto": "model", "eagle3": "eagle3"}


def draft_bundle(
    value: str, *, trim: int | None = None, steps: int | None = None, time_budget_s: float | None = DRAFT_TIME_BUDGET_S
) -> DraftBundleConfig | None:
    """The command's --draft VALUE (auto | eagle3 | none) and its three flags as QuantizeConfig.draft."""
    if value == "none":
        return None
    if value not in DRAFT_KINDS:
        raise RecipeError(
            f"unknown --draft '{value}'", fix="use --draft auto (train a draft), eagle3 (an EAGLE-3 head) or none"
        )
    return DraftBundleConfig(kind=DRAFT_KINDS[value], trim_keep=trim, max_steps=steps, time_budget_s=time_budget_s)


@dataclass(frozen=True)
class QuantizeConfig:
    model: str
    recipe: str
    output: Path
    data: str = data_mod.BUILTIN
    text_field: str = "text"
    images: str | None = None  # image+text calibration rows (JSONL of image, text): calibrate/images.py
    revision: str | None = None  # hub ids: branch, tag or commit
    num_samples: int | None = None  # None: the recipe's
    seq_len: int | None = None
    seed: int | None = None
    chat_template: bool = False
    overwrite: bool = False
    eval_samples: int = 8  # held-out samples for the quality check written into the manifest; 0 = skip
    eval_seq_len: int = 512
    gates: tuple[str, ...] = ()  # added to the recipe's own gates
    recipe_gates: bool = True  # False: ignore the recipe's gates
    device: str = "auto"  # auto (CUDA when present) | cpu | cuda | cuda:N
    compute_dtype: str = "auto"  # the layer passes: auto (tf32 on CUDA, fp32 on a CPU) | fp32 | tf32 | bf16
    chunk_tokens: int = 8192  # calibration tokens per chunk (memory per step; results do not depend on it)
    offload_activations: bool = False  # keep calibration activations on disk instead of RAM
    resume: bool = False  # continue an interrupted run of the same command
    checkpoint_every_s: float = 300.0  # activation checkpoints at least this often (more often when cheap)
    int4_fraction: float | None = None  # mixed recipes: override the recipe's 4-bit FLOP share
    draft: DraftBundleConfig | None = None  # also train a draft for the result, measure it, write the configs
    tp: int | None = None  # flatten recipes: override the tensor-parallel size
    block_size: int | None = None  # block recipes: override the B of block_structure [B, B] and the input group
    group_size: int | None = None  # group-weight recipes: override the weights' group_size
    weights: str | None = None  # "rtn" | "gptq": override the recipe's calibration.weight_method
    smooth_alpha: str | None = None  # "auto" or a number in [0, 1]: override the recipe's smooth.alpha
    sets: tuple[str, ...] = ()  # "section.key=value" recipe overrides, applied after the alias flags
    rotate: bool = False  # add the transform "rotate" to the recipe's transforms
    quantize_lm_head: bool = False  # quantize the LM head too (recipe.head_from), unless the recipe says how
