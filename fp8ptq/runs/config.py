"""The quantize command as one typed value (no torch here: `import fp8ptq.api` stays fast)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8ptq import data as data_mod
from fp8ptq.draft.auto import DRAFT_TIME_BUDGET_S, DraftBundleConfig
from fp8ptq.errors import RecipeError
from fp8ptq.fields import Cli, documented

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
    """`fp8ptq quantize` as one value. Each option's help is its field's (fp8ptq.fields): the command and
    README's option table read it here."""

    model: str = documented(
        help="HF model dir, hub id (org/name), .gguf file, or alias (smollm2-135m)", cli=Cli(argument=True)
    )
    recipe: str = documented(
        help="built-in recipe name or YAML path",
        more=" ([Recipes](#recipes))",
        cli=Cli(flags=("--recipe", "-r"), default="fp8-kv8"),
    )
    output: Path = documented(
        help="output directory (written atomically)",
        more=": it appears only when complete",
        shown="— (required)",
        cli=Cli(flags=("--output", "-o")),
    )
    data: str = documented(
        data_mod.BUILTIN,
        "calibration text: builtin, .txt, .jsonl, .parquet or a datasets folder; PATH:WEIGHT, repeated: a mix",
        more=" (`.txt`: blank-line separated documents; a datasets folder: `datasets.save_to_disk`'s; "
        "`--data builtin:0.5 --data chat.jsonl:0.5`)",
        cli=Cli(joined=","),
    )
    text_field: str = documented("text", "field holding the text in .jsonl/.parquet/datasets")
    images: str | None = documented(  # calibrate/images.py
        None,
        'multimodal checkpoints: a .jsonl of {"image": PATH, "text": TEXT}, each line one image+text '
        "calibration sample in place of a text sample",
        more=' (see "Which models" above)',
    )
    revision: str | None = documented(None, "hub ids: branch, tag or commit (default: main)", shown="main")
    num_samples: int | None = documented(None, "calibration samples (default: the recipe's)", shown="recipe's (64)")
    seq_len: int | None = documented(
        None, "tokens per calibration sample (default: the recipe's)", shown="recipe's (512)"
    )
    seed: int | None = documented(None, "sample-selection seed (default: the recipe's)", shown="recipe's (0)")
    chat_template: bool = documented(False, "wrap each calibration text in the tokenizer's chat template")
    overwrite: bool = documented(
        False,
        "replace an existing output directory (or discard an interrupted run)",
        more=" — only one that fp8ptq wrote; never the input model",
    )
    eval_samples: int = documented(
        8,
        "held-out samples for the quality check (0 = skip)",
        more=": 512-token samples, the quality section of the manifest",
    )
    eval_seq_len: int = 512
    gates: tuple[str, ...] = documented(
        (),
        "quality gate METRIC OP NUMBER, e.g. kl<=0.05, top1>=0.9 (repeatable, added to the recipe's); a "
        "failed gate exits 3",
        more=" ([docs/ci.md](docs/ci.md))",
        cli=Cli(flags=("--gate",)),
    )
    recipe_gates: bool = documented(
        True,
        "check the gates the recipe carries, beside `gates`",
        cli=Cli(negated=True, help="ignore the gates the recipe carries"),
    )
    device: str = documented(
        "auto",
        "auto (CUDA when present), cpu, cuda or cuda:N (one layer at a time is moved there)",
        more=". The progress bar and the summary say which; everything but the current layer and chunk stays in "
        "RAM. On CUDA, GPTQ solves each 128-column block in one Triton kernel (bit for bit the CPU's column loop; "
        "`FP8PTQ_GPTQ_KERNEL=eager` turns it off)",
    )
    compute_dtype: str = documented(
        "auto",
        "arithmetic of the calibration passes: auto (tf32 on CUDA, fp32 on a CPU), fp32, tf32 (CUDA) or "
        "bf16; Hessians and GPTQ stay fp32",
        more=" (Cholesky and the GPTQ updates too); the manifest's `run.compute_dtype` records it",
    )
    chunk_tokens: int = documented(8192, "calibration tokens per step: bounds activation memory, not the result")
    offload_activations: bool = documented(
        False,
        "keep calibration activations on disk (RAM: one chunk)",
        more=", for calibration sets larger than RAM",
    )
    resume: bool = documented(
        False,
        "continue an interrupted run of the same command from its last checkpoint",
        more=" (same bytes as an uninterrupted run)",
    )
    checkpoint_every_s: float = 300.0  # activation checkpoints at least this often (more often when cheap)
    int4_fraction: float | None = documented(
        None, "mixed recipes: share of linear FLOPs at 4 bit", more=" (0–1)", shown="recipe's"
    )
    draft: DraftBundleConfig | None = documented(
        None,
        "auto: also distil a draft from the quantized model (eagle3: train an EAGLE-3 head for it), "
        "measure it and write speculative_config.json + sglang_flags.txt beside it",
        more=" ([Speculative decoding](#speculative-decoding-draft-train-draft-trim-spec-measurerecommendmemory-"
        "quantize---draft-auto))",
    )
    tp: int | None = documented(
        None,
        "flatten recipes: tensor-parallel size the MLP width must divide",
        shown="recipe's",
    )
    block_size: int | None = documented(
        None,
        "block recipes: B of the [B, B] weight blocks and input groups (must divide every width)",
        more="; `fp8-block` on SmolLM2: 64",
        shown="recipe's (128)",
    )
    group_size: int | None = documented(
        None,
        "group-weight recipes (w4a16, w4a8-fp8): input channels per weight scale",
        more=" (must divide every quantized Linear's input; vLLM 0.32's W4A8 kernel takes only 128)",
        shown="recipe's",
    )
    weights: str | None = documented(
        None,
        "rtn (round to nearest: fastest) or gptq: override the recipe's weight rounding",
        more=" (`calibration.weight_method`; `w4a16 --weights rtn` needs no data); the report states which",
        shown="recipe's",
    )
    smooth_alpha: str | None = documented(
        None,
        "SmoothQuant recipes (w8a8-int8, nvfp4, flatten-w8a8): 'auto' (measured per layer) or one "
        "alpha in [0, 1] for every layer: no search, a faster calibration",
        more=" (the search is most of `nvfp4`'s time on a CPU) at the search's quality gain; the manifest records it",
        shown="recipe's",
    )
    sets: tuple[str, ...] = documented(
        (),
        "change any recipe key, repeatable: --set calibration.gptq_damp=0.05 (VALUE is YAML; the flags "
        "above are aliases with their own checks; keys: fp8ptq recipes show NAME)",
        more=". Also `--set scheme.weights.group_size=32`, `--set 'gates=[kl<=0.04]'`; a section the recipe "
        "leaves out is started (`--set smooth.alpha=0.8` adds SmoothQuant), and the result is validated like "
        "a recipe file (an unknown key is named with the valid ones)",
        cli=Cli(flags=("--set",), metavar="KEY=VALUE"),
    )
    rotate: bool = documented(
        False,
        "add the recipe transform 'rotate': Hadamard rotations folded into the float model",
        more=" before calibration (see Recipes)",
        cli=Cli(flags=("--rotate",)),
    )
    quantize_lm_head: bool = documented(
        False,
        "quantize the LM head too, weight-only: INT8 per channel under 8-bit recipes, else the recipe's "
        "weights (a tied head is untied)",
        more='; other heads: the recipe key `scheme.lm_head` (see "Quantized LM head")',
        cli=Cli(flags=("--quantize-lm-head",)),
    )


@dataclass(frozen=True)
class ModelFreeConfig:
    """`fp8ptq model-free` as one value (runs/model_free.py)."""

    model: Path = documented(
        help="a safetensors model directory (any architecture, even one transformers lacks)", cli=Cli(argument=True)
    )
    output: Path = documented(help="output directory (written atomically)", cli=Cli(flags=("--output", "-o")))
    recipe: str = documented(
        "fp8-dynamic", "a data-free recipe: fp8-dynamic, fp8-block", cli=Cli(flags=("--recipe", "-r"))
    )
    dry_run: bool = documented(
        False, "list what would be quantized and kept, and why; write nothing", cli=Cli(flags=("--dry-run",))
    )
    overwrite: bool = documented(False, "replace OUTPUT if fp8ptq wrote it")
