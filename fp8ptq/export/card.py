"""README.md, the export's model card: what a Hub user reads first. YAML front matter in the fields
`huggingface_hub.ModelCard` parses (base_model with `base_model_relation: quantized`, tags, the licence
copied from the source's card), then the body of report.md (scheme, size, gates, quality, the vLLM and
SGLang commands that serve it and its draft).

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


def card_metadata(manifest: Manifest, source_card: str = "") -> dict:
    """The card's front matter: base model, licence (from the source card, when it names one), tags."""
    meta: dict = {}
    source = front_matter(source_card)
    base = base_model(manifest.model)
    if base is not None:
        meta.update(base_model=base, base_model_relation="quantized")
    meta.update({k: source[k] for k in _LICENCE_KEYS if isinstance(source.get(k), str)})
    meta.update(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["fp8ptq", "compressed-tensors", "quantized", *_format_tags(manifest.recipe["scheme"])],
    )
    return meta


def write_card(out_dir: Path, manifest: Manifest, report_md: str) -> Path:
    """OUT/README.md: front matter, then the report's body. A README.md already there (the source's, copied
    as a side file, or an earlier render) lends its licence and is replaced."""
    from fp8ptq.io import write_bytes_atomic

    path = Path(out_dir) / CARD
    existing = ""
    if path.is_file() and not path.is_symlink():
        existing = path.read_text(encoding="utf-8", errors="replace")
    from huggingface_hub import ModelCard, ModelCardData

    meta = card_metadata(manifest, existing)  # an earlier render of ours carries the licence forward
    card = ModelCard(f"---\n{ModelCardData(**meta).to_yaml()}\n---\n\n{report_md}")
    write_bytes_atomic(path, str(card).encode())
    return path
