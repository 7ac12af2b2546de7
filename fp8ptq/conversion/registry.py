"""The converters `fp8ptq convert` has, one entry per (source format, target format).

Each entry names the module that does the work. That module has three functions:

    check(cfg, fmt) -> checked        every typed error its input can raise, before any output exists
    write(cfg, fmt, checked, out) -> dict   the conversion into `out` (a temp directory, or a temp file
                                      for a file target); returns the report ({"summary", "tensors", ...})
    describe(report) -> str           one line for the terminal ("" when there is nothing to say)

This module imports no torch (the CLI builds `--from`/`--to` help from it at start-up); a converter's
module is imported when it runs. `detect.format_of_config` names the format a directory holds;
SOURCES and TARGETS below are what the CLI offers and what `convert` accepts. Adding a converter: its
module, one line in CONVERTERS, its test (docs/DESIGN.md, "How to add a converter").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, runtime_checkable

from fp8ptq.errors import ModelError, OptionError, OutputError
from fp8ptq.fields import Cli, documented


@runtime_checkable
class ConverterModule(Protocol):
    """What a converter's module (CONVERTERS' `module`) provides; see the module docstring."""

    def check(self, cfg: ConvertConfig, fmt: str) -> Any: ...

    def write(self, cfg: ConvertConfig, fmt: str, checked: Any, out: Path) -> dict: ...

    def describe(self, report: dict) -> str: ...


@dataclass(frozen=True)
class Converter:
    source: str  # the format detect names
    target: str  # the --to value
    module: str  # fp8ptq.conversion.<module>: check / write / describe (module docstring)
    what: str  # what is carried, for help and errors
    recipe: bool = False  # takes --recipe
    suffix: str | None = None  # the target is one file ending in this (None: a directory)

    def functions(self) -> ConverterModule:
        module = importlib.import_module(f"fp8ptq.conversion.{self.module}")
        if not isinstance(module, ConverterModule):
            raise TypeError(f"fp8ptq.conversion.{self.module} lacks check / write / describe")
        return module


CONVERTERS = (
    Converter("gguf", "hf", "gguf_hf", "dequantized to float safetensors"),
    Converter("gguf", "compressed-tensors", "gguf_ct", "Q4_0/Q8_0 codes exactly as INT4/INT8 g32", recipe=True),
    Converter("hf-fp8", "compressed-tensors", "hf_fp8", "block-FP8 codes and scales exactly"),
    Converter("gptq", "compressed-tensors", "packed_int", "INT4/INT8 codes, scales and zero points exactly"),
    Converter("awq", "compressed-tensors", "packed_int", "INT4 codes, scales and zero points exactly"),
    Converter("modelopt", "compressed-tensors", "modelopt", "FP8 / NVFP4 codes and scales exactly"),
    Converter("compressed-tensors", "gguf", "ct_gguf", "symmetric INT4/INT8 g32 codes as Q4_0/Q8_0", suffix=".gguf"),
    Converter("float", "gguf", "ct_gguf", "float matrices, or quantized with --gguf-type", suffix=".gguf"),
)
SOURCES = tuple(dict.fromkeys(c.source for c in CONVERTERS))
TARGETS = tuple(dict.fromkeys(c.target for c in CONVERTERS))


@dataclass(frozen=True)
class ConvertConfig:
    """`fp8ptq convert` as one value."""

    source: Path = documented(
        help=".gguf file; a GPTQ / AWQ / ModelOpt / block-FP8 dir (to compressed-tensors); a compressed-tensors "
        "dir (--to gguf)",
        cli=Cli(argument=True),
    )
    output: Path = documented(help="a directory, or NAME.gguf for --to gguf", cli=Cli(flags=("--output", "-o")))
    to: str = documented(
        "hf",
        "; ".join(f"{t}: from {', '.join(c.source for c in CONVERTERS if c.target == t)}" for t in TARGETS),
    )
    dtype: str = documented("bfloat16", "dtype of dequantized / float matrices: bfloat16, float16 or float32")
    recipe: str | None = documented(
        None, "with --to compressed-tensors: re-quantize other GGML quant types with this data-free recipe"
    )
    overwrite: bool = documented(False, "replace an existing output that fp8ptq wrote")
    source_format: str | None = documented(
        None, f"{', '.join(SOURCES)}: confirm the detected format", cli=Cli(flags=("--from",))
    )
    gguf_type: str | None = documented(
        None,
        "with --to gguf: quantize every matrix to llama.cpp's mix Q4_K_M, Q5_K_M, Q6_K, Q8_0 or Q4_0 "
        "(codes already of the chosen type are carried exactly)",
        cli=Cli(flags=("--gguf-type",)),
    )
    importance: str | None = documented(
        None,
        "with --gguf-type: calibration text ('builtin', a .txt/.jsonl/.parquet file) whose mean x^2 per input "
        "column weighs the block search (llama.cpp's imatrix)",
    )
    num_samples: int = documented(32, "--importance: samples of calibration text")
    seq_len: int = documented(512, "--importance: tokens per sample")


@dataclass(frozen=True)
class ConversionReport:
    """What a conversion did. `summary` and `tensors` are the converter's own records (for a directory
    target also written to OUT/conversion.json); `line` is its one-line account. `convert --json`:
    results.to_json of it."""

    SCHEMA: ClassVar[str] = "conversion"
    SCHEMA_VERSION: ClassVar[int] = 1

    output: str
    source_format: str
    target: str
    summary: dict = field(default_factory=dict)
    tensors: list = field(default_factory=list)
    dropped: list = field(default_factory=list)  # source tensors the target has no place for
    line: str = ""


def _targets_from(fmt: str) -> list[str]:
    return [c.target for c in CONVERTERS if c.source == fmt]


def check_options(cfg: ConvertConfig) -> None:
    """The option errors, before the source is read."""
    if cfg.to not in TARGETS:
        raise OptionError(f"unknown --to '{cfg.to}'", fix=f"use one of: {', '.join(TARGETS)}")
    if cfg.source_format is not None and cfg.source_format not in SOURCES:
        raise OptionError(f"unknown --from '{cfg.source_format}'", fix=f"use one of: {', '.join(SOURCES)}")
    if cfg.recipe is not None and not any(c.recipe and c.target == cfg.to for c in CONVERTERS):
        takes = sorted({c.target for c in CONVERTERS if c.recipe})
        raise OptionError(f"--recipe needs --to {' or '.join(takes)}", fix=f"add --to {takes[0]} or drop --recipe")
    if cfg.gguf_type is not None:
        if cfg.to != "gguf":
            raise OptionError("--gguf-type needs --to gguf", fix="add --to gguf or drop --gguf-type")
        from fp8ptq.conversion.gguf_mix import check_ftype

        check_ftype(cfg.gguf_type)
    if cfg.importance is not None and cfg.gguf_type is None:
        raise OptionError(
            "--importance needs --gguf-type", fix="add --to gguf --gguf-type Q4_K_M (or drop --importance)"
        )
    if cfg.num_samples < 1 or cfg.seq_len < 2:
        raise OptionError(
            f"--num-samples {cfg.num_samples} / --seq-len {cfg.seq_len}: need at least 1 sample of 2 tokens",
            fix="use e.g. --num-samples 32 --seq-len 512",
        )
    suffixes = {c.suffix for c in CONVERTERS if c.target == cfg.to}
    for suffix in suffixes - {None}:
        if cfg.output.suffix != suffix:
            raise OutputError(f"output '{cfg.output}' does not end in {suffix}", fix=f"pass -o NAME{suffix}")


def detect_source(path: Path) -> str:
    """The format of `path`; a ModelError when it is none fp8ptq converts."""
    from fp8ptq.conversion.detect import format_of_config, read_json

    if not path.exists():
        raise ModelError(f"'{path}' not found", fix="pass a .gguf file or a checkpoint directory")
    if path.is_file():
        if path.suffix == ".gguf":
            return "gguf"
        raise ModelError(f"'{path}' is not a .gguf file", fix="pass a .gguf file or a checkpoint directory")
    if not (path / "config.json").is_file():
        raise ModelError(f"'{path}' has no config.json", fix="pass a Hugging Face checkpoint directory")
    fmt = format_of_config(path, read_json(path / "config.json"))
    if fmt not in SOURCES:
        hint = "quantize it with `fp8ptq quantize`, or pass" if fmt == "float" else "pass"
        raise ModelError(
            f"'{path}' is a {fmt} checkpoint, which `convert` does not read",
            fix=f"{hint} a checkpoint in one of: {', '.join(SOURCES)}",
        )
    return fmt


def find(cfg: ConvertConfig) -> tuple[Converter, str]:
    """The converter for cfg's source (detected, confirmed against --from) and --to, with the source format."""
    check_options(cfg)
    found = detect_source(cfg.source)
    if cfg.source_format is not None and cfg.source_format != found:
        raise ModelError(
            f"--from {cfg.source_format}, but '{cfg.source}' is a {found} checkpoint",
            fix=f"pass --from {found} (or drop --from), or the {cfg.source_format} checkpoint you meant",
        )
    for c in CONVERTERS:
        if (c.source, c.target) == (found, cfg.to):
            if cfg.recipe is not None and not c.recipe:
                raise ModelError(f"--recipe applies to GGUF sources only, not {found}", fix="drop --recipe")
            return c, found
    if found == "float":
        raise ModelError(
            f"'{cfg.source}' is a float checkpoint; `convert` writes only gguf from it, not {cfg.to}",
            fix="quantize it with `fp8ptq quantize`, or pass --to gguf (--gguf-type Q4_K_M for llama.cpp's mix)",
        )
    fix = "it is that format already" if found == cfg.to else "convert to compressed-tensors first"
    raise ModelError(
        f"'{cfg.source}' is a {found} checkpoint; `convert` writes {', '.join(_targets_from(found))} from it, "
        f"not {cfg.to}",
        fix=f"pass --to {' or --to '.join(_targets_from(found))} ({fix})",
    )


def convert(cfg: ConvertConfig) -> ConversionReport:
    """Find the converter, run its checks, then write the output atomically (a temp dir or file renamed)."""
    from fp8ptq.io import atomic_output_dir, check_not_input, check_output, check_writable, write_atomic

    check_not_input(cfg.output, (cfg.source,))
    conv, found = find(cfg)
    if conv.suffix is None:
        check_output(cfg.output, cfg.overwrite)
    else:
        if cfg.output.exists() and not (cfg.overwrite and cfg.output.is_file()):
            raise OutputError(f"output '{cfg.output}' already exists", fix="choose another -o path or pass --overwrite")
        check_writable(cfg.output.parent)
    module = conv.functions()
    checked = module.check(cfg, found)
    report: dict = {}
    if conv.suffix is None:
        with atomic_output_dir(cfg.output, cfg.overwrite) as tmp:
            report = module.write(cfg, found, checked, tmp)
    else:
        cfg.output.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cfg.output, lambda tmp: report.update(module.write(cfg, found, checked, tmp)))
    return ConversionReport(
        output=str(cfg.output),
        source_format=found,
        target=conv.target,
        summary=report.get("summary", {}),
        tensors=report.get("tensors", []),
        dropped=report.get("dropped", []),
        line=module.describe(report),
    )
