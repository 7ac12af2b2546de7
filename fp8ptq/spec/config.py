"""The configs of `spec measure` and `spec recommend` (spec/run.py runs them). No torch here: the CLI
generates its options from these fields at start-up (cli/fielded.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8ptq.fields import Cli, documented, float_list, int_list


@dataclass(frozen=True)
class MeasureConfig:
    """`fp8ptq spec measure` as one value (and the measuring part of `spec recommend`)."""

    target: str = documented(
        help="target (quantized checkpoint: measured under simulated engine numerics)", cli=Cli(argument=True)
    )
    draft: str = documented(
        help="draft dir (draft-train or draft-trim output, an EAGLE-3 head), ngram[:MIN-MAX] (vLLM's prompt lookup, "
        "default sizes 2-4), suffix[:N] (vLLM's suffix decoding, N cached requests, default 10000; no draft "
        "model) or mtp (the target's own multi-token-prediction layer)",
        cli=Cli(argument=True),
    )
    gammas: tuple[int, ...] = documented(
        (1, 2, 3, 4, 5, 6, 7, 8), "γ values: 1-8 or 1,2,4", cli=Cli(parse=int_list, default="1-8")
    )
    temperatures: tuple[float, ...] = documented((0.0,), "0 = greedy; e.g. 0,1", cli=Cli(parse=float_list, default="0"))
    prompts: str | None = documented(None, "prompt file; default: built-in held-out prompts")
    text_field: str = "text"
    num_prompts: int = documented(8, "held-out prompts measured")
    max_tokens: int = documented(64, "tokens generated per prompt (EOS ignored, like vLLM with ignore_eos)")
    max_prompt_tokens: int = 256
    thresholds: tuple[float, ...] = documented(
        (),
        "dynamic draft length: stop drafting below these draft max-probs, e.g. 0.3,0.5",
        cli=Cli(parse=float_list),
    )
    seed: int = documented(0, "prompt-selection and sampling seed")
    cost_repeats: int = 7
    device: str = documented("cpu", "cpu, cuda or cuda:N")
    prompt_ids: tuple[tuple[int, ...], ...] | None = (
        None  # exact token ids (overrides prompts), e.g. to match a vLLM run
    )
    batch_sizes: tuple[int, ...] = documented(  # schedule.py
        (),
        "also time the costs at these decode batch sizes and write γ per batch size, e.g. 1,8,32",
        cli=Cli(parse=int_list),
    )


@dataclass(frozen=True)
class RecommendConfig:
    """`fp8ptq spec recommend` as one value: what to measure (or a measurement) and what to plan for."""

    output: Path = documented(
        help="folder for speculative_config.json, sglang_flags.txt, plot", cli=Cli(flags=("--output", "-o"))
    )
    measured: Path | None = documented(
        None, "a `spec measure --save` file instead of measuring", cli=Cli(flags=("--measured",))
    )
    measure: MeasureConfig | None = None
    temperature: float = documented(0.0, "recommend for this sampling temperature")
    draft_for_engine: str | None = documented(
        None, "draft path to write into the configs (default: DRAFT)", cli=Cli(flags=("--draft-path",))
    )
    token_map: str | None = documented(
        None, "draft-trim's token_map.pt (recorded; not written to the SGLang flags: SGLang 0.5.23 mis-indexes it)"
    )
    device_memory: str | None = documented(None, "add a memory plan for a device of this size, e.g. 24GiB")
    context: int = documented(4096, "memory plan: tokens per sequence")
    batch: int = documented(1, "memory plan: concurrent sequences")
    kv_dtype: str = documented("auto", "memory plan: KV dtype (auto: fp8 if the checkpoint has a KV scheme)")
    overwrite: bool = documented(False, "replace an existing output folder that fp8ptq wrote")
    costs: dict | None = None  # override the measured costs (e.g. from vLLM), Costs.as_dict() form
    engine_check: bool = documented(
        False,
        "run the chosen config in vLLM vs plain decoding on the same prompts: measured tokens/s and vLLM's "
        "acceptance counters",
        cli=Cli(flags=("--engine-check",)),
    )
    vllm_python: str | None = documented(None, "--engine-check: python of a venv with vLLM (default .venv-vllm)")
