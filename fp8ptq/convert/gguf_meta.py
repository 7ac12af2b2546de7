"""Writing GGUF files: names, row order, model metadata and tokenizer, so that transformers' GGUF loader
(5.23) and gguf-py (0.19) read back what was written.

- tensor names: gguf-py's `get_tensor_name_map(arch, n_layers)` (the table transformers inverts to load);
- row order: llama.cpp's converter permutes q_proj/k_proj rows for its RoPE (ops.ggml.permute_qk); we
  apply it wherever transformers' loader undoes it (its `LlamaTensorProcessor`, GGUF architecture llama);
- model metadata: transformers' own GGUF -> config key table (`GGUF_CONFIG_MAPPING[arch]`) read backwards;
- tokenizer: gguf-py's `BpeVocab` (tokens and types) and `SpecialVocab` (merges, special ids, chat
  template) from the checkpoint's tokenizer.json, as llama.cpp's convert_hf_to_gguf.py does for GPT-2
  style byte-level BPE (Llama 3, SmolLM, Qwen).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fp8ptq.errors import ModelError
from fp8ptq.ops.ggml import permute_qk

# HF model_type -> GGUF architecture (llama.cpp writes Mistral as llama)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def gguf_arch(config) -> str:
    arch = GGUF_ARCH.get(config.model_type)
    if arch is None:
        raise ModelError(
            f"model_type '{config.model_type}' has no GGUF writer in fp8ptq",
            fix=f"supported for --to gguf: {', '.join(sorted(GGUF_ARCH))}",
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ModelError(
            f"rope_type '{rope.get('rope_type')}' is not written to GGUF by fp8ptq (llama.cpp needs extra keys)",
            fix="use llama.cpp's convert_hf_to_gguf.py for this model",
        )
    return arch


def name_map(config):
    """HF tensor name -> GGUF tensor name."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == gguf_arch(config))
    table = get_tensor_name_map(arch, config.num_hidden_layers)

    def to_gguf(name: str) -> str:
        base, _, suffix = name.rpartition(".")
        mapped = table.get_name(base)
        if mapped is None:
            raise ModelError(f"tensor '{name}' has no GGUF name for architecture '{gguf_arch(config)}'")
        return f"{mapped}.{suffix}"

    return to_gguf


def to_gguf_rows(name: str, t: torch.Tensor, config) -> torch.Tensor:
    """Rows of q_proj / k_proj (weight, codes or scales) in llama.cpp's order, where its converter permutes."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    if TENSOR_PROCESSORS.get(gguf_arch(config)).__name__ != "LlamaTensorProcessor":
        return t
    if ".self_attn.q_proj." in name:
        return permute_qk(t, config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        return permute_qk(t, config.num_key_value_heads)
    return t


def _config_value(config, key: str):
    value = getattr(config, key, None)
    if value is None:
        value = (getattr(config, "rope_parameters", None) or {}).get(key)  # rope_theta in transformers 5
    return value


def add_metadata(writer, config, tokenizer_dir: Path, name: str) -> None:
    """Architecture keys, general.* and the tokenizer into a gguf.GGUFWriter."""
    from gguf import GGUFValueType
    from gguf.vocab import BpeVocab, SpecialVocab
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = gguf_arch(config)
    writer.add_name(name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for key, attr in GGUF_CONFIG_MAPPING[arch].items():
        value = head_dim if key == "rope.dimension_count" else _config_value(config, attr) if attr else None
        if value is None or isinstance(value, (list, dict)):
            continue
        vtype = GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32
        writer.add_key_value(f"{arch}.{key}", value, vtype)
    if head_dim != config.hidden_size // config.num_attention_heads:  # what llama.cpp writes for Qwen3
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    try:
        vocab = BpeVocab(Path(tokenizer_dir))
    except (FileNotFoundError, ValueError) as err:
        raise ModelError(
            f"the tokenizer in '{tokenizer_dir}' is not a GPT-2 style byte-level BPE ({err})",
            fix="--to gguf writes byte-level BPE tokenizers only (Llama 3, SmolLM, Qwen)",
        ) from None
    tokens, types = [], []
    for text, _, kind in vocab.all_tokens():
        tokens.append(text)
        types.append(kind)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(Path(tokenizer_dir), load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
