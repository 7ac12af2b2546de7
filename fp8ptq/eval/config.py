"""The configs of the evaluation commands that the CLI generates its options from (cli/fielded.py). No
torch here: the CLI imports this module at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from fp8ptq.fields import Cli, documented

MMLU_PRO = "mmlu_pro"


@dataclass(frozen=True)
class HarnessConfig:
    """`fp8ptq eval mmlu_pro` and `eval tasks` as one value (eval/harness.py)."""

    model: str = documented(
        help="model to evaluate (fp8ptq/compressed-tensors dir, plain dir, .gguf, alias)", cli=Cli(argument=True)
    )
    tasks: tuple[str, ...] = documented(
        (MMLU_PRO,),
        "comma-separated lm-eval task names whose data is local",
        cli=Cli(flags=("--tasks",), split=",", default=...),
    )
    baseline: str | None = documented(
        None, "reference model (dir, .gguf or alias) for the delta", cli=Cli(flags=("--baseline",))
    )
    data: str | None = documented(
        None, "dir with test + validation files in the MMLU-Pro schema (default: the offline HF cache)"
    )
    include_path: str | None = documented(None, "directory of extra lm-eval task YAMLs")
    limit: int | None = documented(None, "questions per (sub)task (default: all)")
    num_fewshot: int | None = documented(None, "few-shot examples (default: the task's; mmlu_pro: 5)")
    max_gen_toks: int | None = documented(None, "cap generated tokens (default: the task's; mmlu_pro: 2048)")
    batch_size: int = documented(4, "lm-eval batch size")
    backend: str = documented("hf", "hf (fp32 + simulated engine numerics) or vllm (if installed)")
    device: str = documented("cpu", "hf backend device: cpu, cuda, cuda:N")
    simulate: bool = documented(
        True,
        "hf backend: simulate the engine's activation and KV quantization beside the dequantized weights",
        cli=Cli(negated=True, help="hf backend: dequantized weights only, no activation/KV quantization"),
    )
    seed: int = 0
    gates: tuple[str, ...] = documented(  # checked before the run
        (),
        "gate on '<task>' (percent) or '<task>_delta' (points), e.g. mmlu_pro_delta>=-1.0",
        cli=Cli(flags=("--gate",)),
    )
