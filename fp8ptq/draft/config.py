"""The configs of the draft commands that the CLI generates its options from (cli/fielded.py). No torch
here: the CLI imports this module at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp8ptq.fields import Cli, documented


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
