"""What `import fp8ptq` offers a Python user: `fp8ptq.quantize(model, recipe, output)` on a path, a hub id,
an alias or a transformers model in memory, with a recipe given by name, path, mapping or as a `Recipe`
built in Python; one typed result. The command line's `quantize` is the same run (api.quantize).

    import fp8ptq
    recipe = fp8ptq.Recipe.builtin("w4a16").set("calibration.gptq_damp", 0.02)
    result = fp8ptq.quantize(model, recipe, "out/w4a16", tokenizer=tokenizer, num_samples=32)
    result.passed, result.manifest.quality.kl

Nothing here prints; progress reaches a callback (stage, done, total), as the CLI's bars do.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fp8ptq.errors import OptionError
from fp8ptq.runs.config import QuantizeConfig

if TYPE_CHECKING:
    from fp8ptq.calibrate.state import Progress
    from fp8ptq.manifest import Manifest
    from fp8ptq.recipe import Recipe

# QuantizeConfig fields fp8ptq.quantize takes as keywords (model, recipe and output are its arguments)
OPTIONS = tuple(f.name for f in dataclasses.fields(QuantizeConfig) if f.name not in ("model", "recipe", "output"))


@dataclass(frozen=True)
class QuantizeResult:
    """A finished export: where it is and its manifest (sizes, quality, the gates and whether they held)."""

    output: Path
    manifest: Manifest

    @property
    def passed(self) -> bool:
        """Every gate held (True when there were none). The CLI exits 3 otherwise; the library returns."""
        return all(g.passed for g in self.manifest.gates)


def quantize(
    model,
    recipe: str | Path | dict | Recipe = "fp8-kv8",
    output: str | Path | None = None,
    *,
    tokenizer=None,
    progress: Progress | None = None,
    **options,
) -> QuantizeResult:
    """Quantize `model` with `recipe` into the folder `output` (written atomically, as the CLI does).

    model: a model folder, a .gguf file, a hub id, an alias (smollm2-135m, gemma3-270m), or a transformers
        PreTrainedModel in memory with its `tokenizer` (read one tensor at a time; the model is not changed).
    recipe: a built-in name, a YAML path, a mapping shaped like the YAML, or a Recipe.
    options: any `fp8ptq quantize` option by its QuantizeConfig field name (num_samples=32, data="a.txt",
        gates=("kl<=0.05",), overwrite=True, ...)."""
    from fp8ptq import api

    if output is None:
        raise OptionError("fp8ptq.quantize needs an output folder", fix='fp8ptq.quantize(model, recipe, "out/q")')
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise OptionError(
            f"unknown option {unknown[0]!r}", fix=f"options are QuantizeConfig fields: {', '.join(OPTIONS)}"
        )
    if isinstance(model, (str, Path)):
        cfg = QuantizeConfig(model=str(model), recipe=recipe, output=Path(output), **options)
        return QuantizeResult(Path(output), api.quantize(cfg, progress))
    from fp8ptq.models.memory import open_memory

    label = str(getattr(model, "name_or_path", "") or type(model).__name__)
    cfg = QuantizeConfig(model=label, recipe=recipe, output=Path(output), **options)
    with tempfile.TemporaryDirectory(prefix="fp8ptq-memory-") as folder:
        src = open_memory(model, tokenizer, Path(folder), label)
        return QuantizeResult(Path(output), api.quantize(cfg, progress, source=src))
