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

import yaml

from fp8ptq.manifest import Manifest

CARD = "README.md"
# The Hub repositories the built-in aliases' GGUF files were made from.
ALIAS_BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}
_LICENCE_KEYS = ("license", "license_name", "license_link")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")
_FRONT = re.compile(r"\A---\s*\n(.*?)\n---\s*(\n|\Z)", re.S)


def front_matter(text: str) -> dict:
    """The YAML front matter of a model card ({} when there is none or it does not parse)."""
    m = _FRONT.match(text)
    if m is None:
        return {}
    try:
        data = yaml.safe_load(m.group(1))
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


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
    meta = card_metadata(manifest, existing)  # an earlier render of ours carries the licence forward
    head = "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n\n"
    write_bytes_atomic(path, (head + report_md).encode())
    return path
