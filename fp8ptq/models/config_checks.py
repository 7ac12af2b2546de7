"""What a model's config.json must say before fp8ptq builds anything from it: an `architectures` class of
the family its model_type names (the engine picks the model class from it), and sizes that are positive
integers, with no more decoder layers than the weights hold."""

from __future__ import annotations

import re
from pathlib import Path

from fp8ptq.errors import ModelError
from fp8ptq.models.arch import arch_for
from fp8ptq.models.arch.discovery import layer_counts


def check_architectures(config, path: Path) -> None:
    """vLLM picks the model class from config.json's `architectures`: it must be a causal-LM class of the
    family fp8ptq calibrates by `model_type` (GPT2LMHeadModel with model_type llama would load the wrong
    model, or none)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    names = getattr(config, "architectures", None)
    if not names:
        return
    allowed = sorted(
        {
            mapping[t]
            for t in arch_for(config).model_types
            for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
            if t in mapping
        }
    )
    wrong = [n for n in names if n not in allowed]
    if wrong and allowed:
        expected = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, allowed[0])
        raise ModelError(
            f"'{path / 'config.json'}' says architectures {names} but model_type '{config.model_type}' "
            f"(the engine picks the model class from architectures)",
            fix=f'set "architectures": ["{expected}"] in config.json',
        )


SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
SIZE_FIELDS += ("vocab_size", "num_hidden_layers", "moe_intermediate_size", "num_experts", "num_local_experts")


def check_sizes(config, weight_map: dict[str, str], path: Path) -> None:
    """Sizes in config.json are positive integers, and it declares no more decoder layers than the weights
    hold: a skeleton is built from these numbers before any tensor is read (10**9 layers would fill memory)."""
    where = path / "config.json"
    config = config.get_text_config()  # a multimodal checkpoint's language model
    for name in SIZE_FIELDS:
        try:
            value = getattr(config, name, None)
        except Exception:  # noqa: BLE001 - per-layer sizes (Gemma 4's head_dim) refuse a global read
            continue
        values = value if isinstance(value, (list, tuple)) else [value]  # per-layer sizes (e.g. OpenELM)
        if value is not None and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
            raise ModelError(f"'{where}': {name} is {value!r}, not a positive integer", fix=f"repair {name}")
    # the fewest layers any count says: a family whose layers hold two sublayers each counts those in
    # num_hidden_layers and builds its layer list from another count (num_layers)
    name, layers = min(layer_counts(config).items(), key=lambda kv: kv[1], default=("num_hidden_layers", None))
    held = {int(m.group(1)) for n in weight_map if (m := re.search(r"\.layers\.(\d+)\.", n))}
    if held and isinstance(layers, int) and layers > len(held):
        raise ModelError(
            f"'{where}' says {name} {layers} but the weights hold {len(held)} decoder layers",
            fix="use the config.json that belongs to these weights",
        )


def check_same_vocabulary(
    model, reference, reference_tokenizer, fix: str = "compare a quantized checkpoint with the model it was made from"
) -> None:
    """ModelError unless `model` reads the token ids of `reference`'s tokenizer as the same tokens: the
    same vocabulary size and, where it ships one, the same tokenizer (a comparison of logits over
    different vocabularies means nothing, and an id past the embedding is an IndexError)."""

    def size(src) -> int | None:
        return getattr(src.config.get_text_config(), "vocab_size", None)

    if size(model) != size(reference):
        raise ModelError(
            f"'{model.label}' has a vocabulary of {size(model)} tokens but the reference '{reference.label}' "
            f"{size(reference)}: they are not the same model family",
            fix=fix,
        )
    if any((Path(model.path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        if model.tokenizer().get_vocab() != reference_tokenizer.get_vocab():
            raise ModelError(
                f"'{model.label}' and the reference '{reference.label}' have different tokenizers",
                fix=fix,
            )
