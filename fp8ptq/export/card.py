"""README.md, the export's model card: what a Hub user reads first. YAML front matter in the fields
`huggingface_hub.ModelCard` parses (base_model with `base_model_relation: quantized`, tags, the licence
copied from the source's card), then the body: for `quantize`, report.md (scheme, size, gates, quality,
the vLLM and SGLang commands that serve it and its draft); for `model-free`, what was quantized and kept
by which rule, and the serve commands.

The source's own README.md, which describes the float model, is copied into the export with its other
side files; it is read here for its licence and then replaced.
"""

from __future__ import annotations

import re
from pathlib import Path

from fp8ptq.manifest import Manifest

CARD = "README.md"
# The Hub repositories the built-in aliases' GGUF files were made from.
ALIAS_BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}
_LICENCE_KEYS = ("license", "license_name", "license_link")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")


def front_matter(text: str) -> dict:
    """The metadata of a model card as huggingface_hub reads it ({} when it has none or it does not parse)."""
    from huggingface_hub import ModelCard

    if not text.lstrip().startswith("---"):  # no front matter (huggingface_hub would log that it found none)
        return {}
    try:
        return ModelCard(text, ignore_metadata_errors=True).data.to_dict()
    except Exception:  # noqa: BLE001 - a source card's YAML may be anything; its licence is then unknown
        return {}


def base_model(label: str) -> str | None:
    """The Hub id the export was made from: an alias's source repository, or `label` when it is a hub id
    rather than a local path; None for a local folder or file (the Hub would refuse a path there)."""
    if label in ALIAS_BASE_MODELS:
        return ALIAS_BASE_MODELS[label]
    if _HUB_ID.fullmatch(label) and not Path(label).expanduser().exists():
        return label
    return None


def _format_tags(scheme: dict) -> list[str]:
    weights = scheme.get("weights") or {}
    if not weights:
        return []
    kind = {"float": "fp", "int": "int"}[weights["type"]] + str(weights["num_bits"])
    tags = [{"fp8": "fp8", "fp4": "fp4"}.get(kind, kind)]
    if weights.get("group_size") == 16 and kind == "fp4":
        tags.append("nvfp4")
    if scheme.get("kv_cache"):
        tags.append("kv-cache-quantized")
    return tags


def engine_commands(path: str, kv: bool) -> dict[str, str]:
    """The vLLM and SGLang commands that serve the export at `path` (an FP8 KV cache when `kv`)."""
    vllm = f"vllm serve {path}" + (" --kv-cache-dtype fp8" if kv else "")
    sglang = f"python -m sglang.launch_server --model-path {path}" + (" --kv-cache-dtype fp8_e4m3" if kv else "")
    python = f'from vllm import LLM\nllm = LLM(model="{path}"' + (', kv_cache_dtype="fp8"' if kv else "") + ")"
    return {"vllm": vllm, "sglang": sglang, "vllm_python": python}


def card_front_matter(label: str, scheme: dict, source_card: str = "") -> dict:
    """The card's front matter for an export of `label` under `scheme` (the recipe record's): base model,
    licence (from the source card, when it names one), tags."""
    meta: dict = {}
    source = front_matter(source_card)
    base = base_model(label)
    if base is not None:
        meta.update(base_model=base, base_model_relation="quantized")
    meta.update({k: source[k] for k in _LICENCE_KEYS if isinstance(source.get(k), str)})
    meta.update(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["fp8ptq", "compressed-tensors", "quantized", *_format_tags(scheme)],
    )
    return meta


def card_metadata(manifest: Manifest, source_card: str = "") -> dict:
    """The front matter of a quantize export's card."""
    return card_front_matter(manifest.model, manifest.recipe["scheme"], source_card)


def _write(out_dir: Path, metadata, body: str) -> Path:
    """OUT/README.md from `metadata(existing card text)` and `body`. A README.md already there (the source's,
    copied as a side file, or an earlier render) lends its licence and is replaced."""
    from huggingface_hub import ModelCard, ModelCardData

    from fp8ptq.io import write_bytes_atomic

    path = Path(out_dir) / CARD
    existing = ""
    if path.is_file() and not path.is_symlink():
        existing = path.read_text(encoding="utf-8", errors="replace")
    card = ModelCard(f"---\n{ModelCardData(**metadata(existing)).to_yaml()}\n---\n\n{body}")
    write_bytes_atomic(path, str(card).encode())
    return path


def write_model_free_card(out_dir: Path, summary, scheme: dict, serve_path: str) -> Path:
    """OUT/README.md of a `model-free` export: `summary` its runs.model_free.ModelFreeSummary, `scheme` the
    recipe record's scheme."""
    name = Path(serve_path).name
    lines = [
        f"# {name}",
        "",
        f"`{summary.model}` quantized with the data-free recipe `{summary.recipe}` by `fp8ptq model-free`: "
        "each tensor placed by its name and shape, without building the model and without calibration data. "
        "`model_free.json` lists every decision.",
        "",
        "| decision | tensors |",
        "|---|---|",
        *(f"| {why} | {len(names)} |" for why, names in summary.by_reason.items()),
        "",
        "Kept in float (the checkpoint's `ignore`): " + (", ".join(f"`{n}`" for n in summary.ignore) or "none"),
        "",
        "## Serve",
        "",
        "```bash",
        *(
            cmd
            for key, cmd in engine_commands(serve_path, bool(scheme.get("kv_cache"))).items()
            if key != "vllm_python"
        ),
        "```",
        "",
    ]
    return _write(out_dir, lambda existing: card_front_matter(summary.model, scheme, existing), "\n".join(lines))


def write_card(out_dir: Path, manifest: Manifest, report_md: str) -> Path:
    """OUT/README.md of a quantize export: front matter, then the report's body."""
    return _write(out_dir, lambda existing: card_metadata(manifest, existing), report_md)
