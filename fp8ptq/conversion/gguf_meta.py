"""Writing GGUF files: names, row order, model metadata and tokenizer, so that transformers' GGUF loader
(5.23) and gguf-py (0.19) read back what was written.

- tensor names: gguf-py's `get_tensor_name_map(arch, n_layers)` (the table transformers inverts to load);
- row order: llama.cpp's converter permutes q_proj/k_proj rows for its RoPE (ops.ggml.permute_qk); we
  apply it wherever transformers' loader undoes it (its `LlamaTensorProcessor`, GGUF architecture llama);
- model metadata: transformers' own GGUF -> config key table (`GGUF_CONFIG_MAPPING[arch]`) read backwards;
- tokenizer: gguf-py's `BpeVocab` (tokens and types) and `SpecialVocab` (merges, special ids, chat
  template) from the checkpoint's tokenizer.json, as llama.cpp's convert_hf_to_gguf.py does for GPT-2
  style byte-level BPE (Llama 3, SmolLM, Qwen); Gemma 3's SentencePiece-style vocabulary as its own
  (`_add_spm_tokenizer`);
- values: Gemma's RMSNorm weights as llama.cpp stores them (`to_gguf_values`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fp8ptq.errors import ModelError
from fp8ptq.ops.ggml import permute_qk

# HF model_type -> GGUF architecture (llama.cpp writes Mistral as llama)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
# llama.cpp's Gemma 3 (src/llama-model.cpp, llama-cpp-python 0.3.36) fixes what the GGUF does not say:
# every sixth layer global, the others sliding with RoPE base 10000.
GEMMA3_SWA_PATTERN, GEMMA3_LOCAL_ROPE_THETA = 6, 10000.0


def gguf_arch(config) -> str:
    arch = GGUF_ARCH.get(config.model_type)
    if arch is None:
        raise ModelError(
            f"model_type '{config.model_type}' has no GGUF writer in fp8ptq",
            fix=f"supported for --to gguf: {', '.join(sorted(GGUF_ARCH))}",
        )
    ropes = _ropes(config)
    for rope in ropes.values():
        if rope.get("rope_type", "default") != "default":
            raise ModelError(
                f"rope_type '{rope.get('rope_type')}' is not written to GGUF by fp8ptq (llama.cpp needs extra keys)",
                fix="use llama.cpp's convert_hf_to_gguf.py for this model",
            )
    if arch == "gemma3":
        _check_gemma3(config, ropes)
    return arch


def _ropes(config) -> dict[str, dict]:
    """Layer type -> RoPE parameters ("default" for a config with one set for every layer)."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope and all(isinstance(v, dict) for v in rope.values()):
        return rope
    return {"default": rope}


def _check_gemma3(config, ropes: dict) -> None:
    types = list(getattr(config, "layer_types", None) or [])
    want = ["full_attention" if (i + 1) % GEMMA3_SWA_PATTERN == 0 else "sliding_attention" for i in range(len(types))]
    local = ropes.get("sliding_attention", {}).get("rope_theta", GEMMA3_LOCAL_ROPE_THETA)
    if types != want or local != GEMMA3_LOCAL_ROPE_THETA:
        raise ModelError(
            "this Gemma 3's layer pattern or local RoPE base is not llama.cpp's (every sixth layer global, "
            f"local base {GEMMA3_LOCAL_ROPE_THETA:g}; here {local:g}): a GGUF of it would run differently",
            fix="use llama.cpp's convert_hf_to_gguf.py for this model",
        )


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


def to_gguf_values(gguf_name: str, t: torch.Tensor, config) -> torch.Tensor:
    """A float tensor as llama.cpp stores it: Gemma's RMSNorm weights w as 1 + w (llama.cpp multiplies by the
    stored weight; transformers' GGUF loader subtracts the 1 again: its Gemma2TensorProcessor)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS.get(gguf_arch(config))
    if processor is not None and processor.__name__ == "Gemma2TensorProcessor" and "norm.weight" in gguf_name:
        return t.float() + 1
    return t


def to_gguf_rows(name: str, t: torch.Tensor, config) -> torch.Tensor:
    """Rows of q_proj / k_proj (weight, codes or scales) in llama.cpp's order, where its converter permutes."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS.get(gguf_arch(config))
    if processor is None or processor.__name__ != "LlamaTensorProcessor":
        return t
    if ".self_attn.q_proj." in name:
        return permute_qk(t, config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        return permute_qk(t, config.num_key_value_heads)
    return t


# tokenizer.json pre-tokenizer regexes whose llama.cpp pre-tokenizer name is known (the "original regex from
# tokenizer.json" comments of src/llama-vocab.cpp, llama.cpp vendored by llama-cpp-python 0.3.36)
_L3 = "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}%s| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
_SPLIT_PRE = {
    _L3 % "{1,3}" + "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "llama-bpe",  # numbers in threes
    _L3 % "" + "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+": "qwen2",  # digits one by one
}


def tokenizer_pre(tokenizer_json: dict | None) -> tuple[str, str]:
    """(llama.cpp's `tokenizer.ggml.pre` name, why when it is a guess) for a parsed tokenizer.json (None: none
    readable): llama.cpp splits text with a regex chosen by this name, which must be the one the tokenizer's own
    pre-tokenizer applies, or llama.cpp tokenizes text differently from transformers (measured: with "default",
    llama.cpp tokenized 0 of 18 held-out SmolLM2 texts as transformers does). Read from the pre-tokenizer spec:
      ByteLevel(use_regex)                         -> gpt-2   (GPT-2's regex, llama.cpp LLAMA_VOCAB_PRE_TYPE_GPT2)
      Digits(individual) + ByteLevel(use_regex)    -> smollm  (digits one by one, then GPT-2's regex)
      Split(Llama 3's / Qwen2's regex) + ByteLevel -> llama-bpe / qwen2
    anything else -> "default", with the reason (llama.cpp may then split text differently)."""
    if tokenizer_json is None:
        return "default", "no readable tokenizer.json"
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [st.get("type") for st in steps]
    byte_regex = steps[-1].get("type") == "ByteLevel" and steps[-1].get("use_regex", True)
    if kinds == ["ByteLevel"] and byte_regex:
        return "gpt-2", ""
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_regex:
        return "smollm", ""
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in _SPLIT_PRE:
            return _SPLIT_PRE[regex], ""
    return "default", f"pre-tokenizer {kinds} has no llama.cpp name in fp8ptq: llama.cpp may split text differently"


def _tokenizer_json(tokenizer_dir: Path) -> dict | None:
    try:
        return json.loads((tokenizer_dir / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None


def _added_token_types(tokenizer_json: dict | None) -> dict:
    """id -> GGUF token type of tokenizer.json's added tokens: CONTROL for special ones, USER_DEFINED for the
    rest, as llama.cpp's converter marks them. gguf-py's BpeVocab types an added token that is also in the
    base vocabulary (SmolLM2's <|im_start|>, id 1) as NORMAL, and llama.cpp then splits "<|im_start|>" in
    text into 7 tokens."""
    from gguf import TokenType

    added = (tokenizer_json or {}).get("added_tokens") or []
    return {a["id"]: TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED for a in added}


def _config_value(config, key: str):
    value = getattr(config, key, None)
    if value is None:  # rope_theta in transformers 5: the global layers' where layer types differ
        ropes = _ropes(config)
        value = ropes.get("full_attention", ropes.get("default", {})).get(key)
    return value


def add_metadata(writer, config, tokenizer_dir: Path, name: str) -> tuple[str, str]:
    """Architecture keys, general.* and the tokenizer into a gguf.GGUFWriter; returns `tokenizer_pre`'s
    (name, why it is a guess)."""
    from gguf import GGUFValueType
    from gguf.vocab import BpeVocab, SpecialVocab
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    arch = gguf_arch(config)
    writer.add_name(name)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    written = set()
    for key, attr in GGUF_CONFIG_MAPPING[arch].items():
        value = head_dim if key == "rope.dimension_count" else _config_value(config, attr) if attr else None
        if value is None or isinstance(value, (list, dict)):
            continue
        vtype = GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32
        writer.add_key_value(f"{arch}.{key}", value, vtype)
        written.add(key)
    if head_dim != config.hidden_size // config.num_attention_heads:  # what llama.cpp writes for Qwen3, Gemma 3
        for key, add in (
            ("attention.key_length", writer.add_key_length),
            ("attention.value_length", writer.add_value_length),
        ):
            if key not in written:
                add(head_dim)
    if arch == "gemma3":  # a SentencePiece vocabulary (llama.cpp's "llama" tokenizer model)
        return _add_spm_tokenizer(writer, Path(tokenizer_dir))
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
    tokenizer_json = _tokenizer_json(Path(tokenizer_dir))
    for token_id, kind in _added_token_types(tokenizer_json).items():
        if token_id < len(types):
            types[token_id] = kind
    writer.add_tokenizer_model("gpt2")
    pre, why = tokenizer_pre(tokenizer_json)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    SpecialVocab(Path(tokenizer_dir), load_merges=True, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
    return pre, why


def _add_spm_tokenizer(writer, tokenizer_dir: Path) -> tuple[str, str]:
    """A SentencePiece-style BPE tokenizer.json (byte fallback, "▁" for spaces: Gemma's) as llama.cpp's
    "llama" tokenizer model, spelled as llama.cpp's converter writes Gemma's: tokens by id with runs of
    spaces as spaces (transformers' GGUF reader respells them), types CONTROL for special added tokens,
    USER_DEFINED for other added ones and the space runs, BYTE for <0xNN>; scores -1000 for those, 0 for
    bytes and, for the rest, minus their rank from the first ordinary token (the order llama.cpp merges in
    and transformers rebuilds the merges from). Returns (tokenizer_pre, why)."""
    import re

    from gguf import TokenType
    from gguf.vocab import SpecialVocab
    from transformers import AutoTokenizer

    tokenizer_json = _tokenizer_json(tokenizer_dir)
    model = (tokenizer_json or {}).get("model") or {}
    if model.get("type") != "BPE" or not model.get("byte_fallback"):
        raise ModelError(
            f"the tokenizer in '{tokenizer_dir}' is not a SentencePiece-style BPE (byte fallback)",
            fix="--to gguf writes Gemma 3 with its own tokenizer (tokenizer.json from the model)",
        )
    added = {a["id"]: a for a in tokenizer_json.get("added_tokens") or []}
    vocab = {**model["vocab"], **{a["content"]: i for i, a in added.items()}}
    by_id = {i: t for t, i in vocab.items()}
    n = max(by_id) + 1
    missing = sorted(set(range(n)) - set(by_id))
    if missing:
        raise ModelError(f"the tokenizer in '{tokenizer_dir}' has no token with id {missing[0]}")
    tokens, types = [], []
    for i in range(n):
        text = by_id[i]
        spaces = len(text) > 1 and set(text) == {"▁"}
        tokens.append(" " * len(text) if spaces else text)
        if i in added:
            types.append(TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
        elif spaces:
            types.append(TokenType.USER_DEFINED)
        else:
            types.append(TokenType.BYTE if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text) else TokenType.NORMAL)
    first = next((i for i, k in enumerate(types) if k == TokenType.NORMAL), 0)
    scores = [
        -(i - first) if k == TokenType.NORMAL else 0.0 if k == TokenType.BYTE else -1000.0 for i, k in enumerate(types)
    ]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([float(x) for x in scores])
    writer.add_token_types(types)
    special = SpecialVocab(tokenizer_dir, load_merges=False, n_vocab=n)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    probe = tok("a")["input_ids"]
    special.add_special_token.setdefault("bos", bool(probe) and probe[0] == tok.bos_token_id)
    special.add_special_token.setdefault("eos", bool(probe) and probe[-1] == tok.eos_token_id)
    special.add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)  # "▁" comes from the text's spaces alone, as transformers splits
    return "default", ""
