"""Model-free, data-free quantization: any safetensors checkpoint, including one whose architecture
transformers cannot build, quantized shard by shard from tensor names and shapes alone.

Nothing is instantiated and no activation is seen, so only recipes that need no data qualify (RTN
weights with dynamic or no activation quantization: fp8-dynamic, fp8-block, ...). Which tensors are
quantized is decided by rules the user can read (`RULES`, `--dry-run` lists every decision): a 2-D
floating `*.weight` is a Linear unless its module is an embedding, the LM head, an MoE router or part
of a vision/audio tower (kept in their dtype, the Linears among them listed in `ignore` the way vLLM
expects). A tensor no rule can place (a fused 3-D expert parameter, an already quantized dtype) is
named and refused: never guessed. Each output tensor is what `fp8ptq quantize` writes for the same
recipe (the scheme handlers' own packing), so the two paths agree byte for byte where both run."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from fp8ptq.errors import ModelError, RecipeError
from fp8ptq.export.card import write_model_free_card
from fp8ptq.export.compressed_tensors import compress_linear, quantization_config
from fp8ptq.io import ST_DTYPES, atomic_output_dir, write_json_atomic
from fp8ptq.manifest import MODEL_FREE_RECORD
from fp8ptq.models.folder import side_files
from fp8ptq.models.loader import check_finite, read_weight_map
from fp8ptq.quantization.schemes import LinearScheme, handler
from fp8ptq.quantization.weights import quantize_group
from fp8ptq.recipe import Recipe, load_recipe
from fp8ptq.recipe_files import recipe_record
from fp8ptq.runs.config import ModelFreeConfig

QUANTIZE, KEEP = "quantize", "keep"
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# (rule, pattern on the module name, what happens); the first match decides. Kept Linears go to `ignore`.
RULES: tuple[tuple[str, re.Pattern, str], ...] = (
    (
        "embedding",
        re.compile(r"(^|\.)(embed\w*|\w*embeddings?|wte|wpe)$"),  # embed_tokens, embed_positions, word_embeddings
        KEEP,
    ),
    # `output`: llama.cpp-style names; `shared_head.head`: an MTP layer's own copy of the head (DeepSeek-V3)
    ("LM head", re.compile(r"(^|\.)(lm_head|embed_out|shared_head\.head)$|^output$"), KEEP),
    ("MoE router (engines never quantize it)", re.compile(r"(^|\.)(gate|router|gating|wg|router\.layer)$"), KEEP),
    # an MTP layer's input projection: vLLM builds it as a plain nn.Linear (deepseek_mtp.py, glm4_moe_mtp.py)
    ("MTP projection (engines build it unquantized)", re.compile(r"(^|\.)eh_proj$"), KEEP),
)
# A multimodal checkpoint's towers and projectors: every tensor under them keeps its dtype, whatever its
# shape, and the engine is told to leave them alone by one `ignore` pattern per tower.
TOWER = re.compile(r"(^|\.)(vision\w*|visual|image\w*|audio\w*|multi_modal_projector|mm_projector|vit)(\.|$)")
TOWER_REASON = "vision / audio tower or projector (kept in float)"


@dataclass
class Decision:
    name: str
    shape: tuple[int, ...]
    dtype: str
    action: str  # quantize | keep | copy
    reason: str


@dataclass
class Plan:
    decisions: list[Decision] = field(default_factory=list)

    def of(self, action: str) -> list[Decision]:
        return [d for d in self.decisions if d.action == action]

    def ignore(self) -> list[str]:
        """What the engine must not quantize: one `re:` pattern per tower, then the exact names of the other
        modules kept in float that an engine builds as Linears (LM head, routers)."""
        towers = {m.group(2) for d in self.decisions if d.reason == TOWER_REASON and (m := TOWER.search(d.name))}
        kept = [d for d in self.of(KEEP) if len(d.shape) == 2 and d.reason not in ("embedding", TOWER_REASON)]
        return [f"re:.*{re.escape(t)}\\..*" for t in sorted(towers)] + sorted({d.name[:-7] for d in kept})

    def by_reason(self) -> dict[str, list[str]]:
        """Tensor names per 'action: reason', in the order the decisions were made."""
        out: dict[str, list[str]] = {}
        for d in self.decisions:
            out.setdefault(f"{d.action}: {d.reason}", []).append(d.name)
        return out


@dataclass(frozen=True)
class ModelFreeSummary:
    """What `model_free` decided (and, unless a dry run, wrote): model_free.json in the export."""

    model: str
    recipe: str
    ignore: list[str]  # the Linears kept in float, as the export's `ignore` names them
    tensors: int
    quantized: int
    by_reason: dict[str, list[str]]  # tensor names per "action: reason"

    def as_dict(self) -> dict:
        return asdict(self)


def data_free_recipe(name: str) -> Recipe:
    recipe = load_recipe(name)
    if recipe.needs_data or any(x is not None for x in (recipe.mixed, recipe.smooth, recipe.flatten)):
        raise RecipeError(
            f"recipe '{recipe.name}' needs calibration data (static activation or KV scales, GPTQ or a "
            "transform), which the model-free path does not run",
            fix="use a data-free recipe (fp8-dynamic, fp8-block) or `fp8ptq quantize` on a supported family",
        )
    if recipe.scheme.lm_head is not None:
        raise RecipeError(
            f"recipe '{recipe.name}' quantizes the LM head (scheme.lm_head); the model-free path keeps it as stored",
            fix="drop scheme.lm_head, or use `fp8ptq quantize ... --quantize-lm-head` on a model transformers builds",
        )
    return recipe


def _block(recipe: Recipe) -> tuple[int, int] | None:
    w = recipe.scheme.weights
    return tuple(w.block_structure) if w.strategy == "block" and w.block_structure else None


def decide(name: str, shape: tuple[int, ...], dtype: str, recipe: Recipe) -> Decision:
    """The rule that places one tensor (RULES; a ModelError for one no rule can place)."""
    torch_dtype = ST_DTYPES.get(dtype)
    if TOWER.search(name):
        return Decision(name, shape, dtype, KEEP, TOWER_REASON)
    if len(shape) >= 2 and not name.endswith(".weight") and torch_dtype in FLOAT_DTYPES:
        raise ModelError(
            f"tensor '{name}' {list(shape)} is a {len(shape)}-D parameter that is not a module's weight (fused "
            "experts, e.g.): the model-free path cannot tell whether the engine quantizes it",
            fix="quantize this family with `fp8ptq quantize` (its adapter knows the layout)",
        )
    if not name.endswith(".weight") or len(shape) <= 1:
        return Decision(name, shape, dtype, "copy", "not a Linear weight (bias, norm, scale, buffer)")
    if torch_dtype not in FLOAT_DTYPES:
        raise ModelError(
            f"tensor '{name}' is {dtype}: the checkpoint is already quantized",
            fix="convert it with `fp8ptq convert`, or start from the float checkpoint",
        )
    module = name[: -len(".weight")]
    if len(shape) != 2:
        raise ModelError(
            f"tensor '{name}' has shape {list(shape)}: a {len(shape)}-D weight (fused experts or a convolution) "
            "that the model-free path cannot place by name",
            fix="quantize this family with `fp8ptq quantize` (its adapter knows the layout)",
        )
    if 0 in shape:
        raise ModelError(
            f"tensor '{name}' has shape {list(shape)}: an empty weight (no module has a dimension of 0)",
            fix="use a checkpoint whose weights were saved whole",
        )
    for reason, pattern, action in RULES:
        if pattern.search(module):
            return Decision(name, shape, dtype, action, reason)
    b = _block(recipe)
    if b is not None and (shape[0] % b[0] or shape[1] % b[1]):
        return Decision(name, shape, dtype, KEEP, f"not whole {b[0]}x{b[1]} blocks")
    return Decision(name, shape, dtype, QUANTIZE, "a Linear weight (2-D, floating)")


def plan_model_free(path: Path, weight_map: dict[str, str], recipe: Recipe) -> Plan:
    plan = Plan()
    for shard in sorted(set(weight_map.values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                plan.decisions.append(decide(name, tuple(sl.get_shape()), sl.get_dtype(), recipe))
    return plan


def _quantized(name: str, t: torch.Tensor, recipe: Recipe) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of one Linear, as `fp8ptq quantize`'s data-free path packs them."""
    w = recipe.scheme.weights
    module = name[: -len(".weight")]
    h = handler(w)
    weight_only = recipe.scheme.input_activations is None
    if h.packs_directly(w, recipe.calibration, weight_only):
        tensors, _ = h.pack({module: t}, w)[module]
    else:
        qw = quantize_group({module: t}, w, recipe.calibration, None, weight_only)[module]
        tensors = compress_linear(qw.fake, qw.params, LinearScheme(w, recipe.scheme.input_activations))
    return {f"{module}.{k}": v for k, v in tensors.items()}


def model_free(cfg: ModelFreeConfig, progress=None) -> ModelFreeSummary:
    """Quantize `cfg.model` by tensor names (or, with dry_run, only decide). Returns the plan summary."""
    from safetensors.torch import save_file

    path = Path(cfg.model)
    if not (path / "config.json").is_file():
        raise ModelError(f"'{path}' has no config.json", fix="pass a Hugging Face model directory (safetensors)")
    copied = side_files(path)  # checked before any work: inside the folder, regular, bounded
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read '{path / 'config.json'}' ({type(err).__name__}: {err})") from None
    if not isinstance(config, dict) or config.get("quantization_config") is not None:
        raise ModelError(
            f"'{path}' is already quantized (config.json has a quantization_config)",
            fix="start from the float checkpoint",
        )
    recipe = data_free_recipe(cfg.recipe)
    weight_map = read_weight_map(path)
    plan = plan_model_free(path, weight_map, recipe)
    summary = ModelFreeSummary(
        model=str(path),
        recipe=recipe.name,
        ignore=plan.ignore(),
        tensors=len(plan.decisions),
        quantized=len(plan.of(QUANTIZE)),
        by_reason=plan.by_reason(),
    )
    if cfg.dry_run:
        return summary
    if not plan.of(QUANTIZE):
        raise ModelError(f"no tensor of '{path}' is a Linear weight by the model-free rules", fix="see --dry-run")
    decisions = {d.name: d for d in plan.decisions}
    shards = sorted(set(weight_map.values()))
    new_map: dict[str, str] = {}
    with atomic_output_dir(cfg.output, cfg.overwrite, inputs=(path,)) as tmp:
        for i, shard in enumerate(shards):
            out: dict[str, torch.Tensor] = {}
            with safe_open(str(path / shard), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    if decisions[name].action == QUANTIZE:
                        out.update(_quantized(name, check_finite(name, t), recipe))
                    else:
                        out[name] = t
            save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / shard), metadata={"format": "pt"})
            new_map.update(dict.fromkeys(out, shard))
            if progress:
                progress("model-free", i + 1, len(shards))
        if (path / "model.safetensors.index.json").is_file():
            write_json_atomic(tmp / "model.safetensors.index.json", {"metadata": {}, "weight_map": new_map})
        ignore = tuple(dict.fromkeys([*recipe.scheme.ignore, *plan.ignore()]))  # the recipe's (lm_head) first
        scheme = recipe.scheme.model_copy(update={"ignore": ignore})
        config["quantization_config"] = quantization_config(recipe.model_copy(update={"scheme": scheme}))
        write_json_atomic(tmp / "config.json", config, trailing_newline=True)
        for f in copied:  # tokenizer, chat template, processor, generation config: as they were
            if f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(f, tmp / f.name)
        write_json_atomic(tmp / MODEL_FREE_RECORD, summary.as_dict(), trailing_newline=True)
        write_model_free_card(tmp, summary, recipe_record(recipe)["scheme"], str(cfg.output))
    return summary
