"""Synthetic Llama-shaped checkpoints for scaling tests and benchmarks: random weights with injected
outlier channels (as real LLMs have), written layer by layer as sharded safetensors, so a model far
larger than RAM can be generated. The tokenizer is copied from a real model directory.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class SyntheticSpec:
    layers: int = 4
    hidden: int = 1024
    intermediate: int = 4096
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 49152
    outlier_channels: int = 4  # residual channels whose RMSNorm weight is large: activation outliers
    outlier_scale: float = 20.0
    seed: int = 0


def _linear(out_f: int, in_f: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(torch.bfloat16)


def write_synthetic(out: Path, tokenizer_dir: Path, spec: SyntheticSpec = SyntheticSpec()) -> Path:
    """Write an HF Llama directory (config, tokenizer, one shard per decoder layer + one for the rest)."""
    from transformers import LlamaConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(spec.seed)
    head_dim = spec.hidden // spec.heads
    outliers = torch.randperm(spec.hidden, generator=g)[: spec.outlier_channels]
    files = spec.layers + 1
    weight_map, total = {}, 0
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        norm1 = torch.ones(spec.hidden)
        norm1[outliers] = spec.outlier_scale
        t = {
            p + "self_attn.q_proj.weight": _linear(spec.heads * head_dim, spec.hidden, g),
            p + "self_attn.k_proj.weight": _linear(spec.kv_heads * head_dim, spec.hidden, g),
            p + "self_attn.v_proj.weight": _linear(spec.kv_heads * head_dim, spec.hidden, g),
            p + "self_attn.o_proj.weight": _linear(spec.hidden, spec.heads * head_dim, g),
            p + "mlp.gate_proj.weight": _linear(spec.intermediate, spec.hidden, g),
            p + "mlp.up_proj.weight": _linear(spec.intermediate, spec.hidden, g),
            p + "mlp.down_proj.weight": _linear(spec.hidden, spec.intermediate, g),
            p + "input_layernorm.weight": norm1.to(torch.bfloat16),
            p + "post_attention_layernorm.weight": norm1.to(torch.bfloat16),
        }
        name = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        save_file(t, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in t})
        total += sum(v.numel() * v.element_size() for v in t.values())
    rest = {
        "model.embed_tokens.weight": (torch.randn(spec.vocab, spec.hidden, generator=g) * 0.02).to(torch.bfloat16),
        "model.norm.weight": torch.ones(spec.hidden, dtype=torch.bfloat16),
    }
    name = f"model-{files:05d}-of-{files:05d}.safetensors"
    save_file(rest, str(out / name), metadata={"format": "pt"})
    weight_map.update({k: name for k in rest})
    total += sum(v.numel() * v.element_size() for v in rest.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    cfg = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    )
    cfg.save_pretrained(str(out))
    for f in Path(tokenizer_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name in (
            "vocab.json",
            "merges.txt",
        ):
            shutil.copy2(f, out / f.name)
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tokenizer(out: Path, vocab_size: int = 1024) -> Path:
    """A small byte-level BPE tokenizer trained in-process on CPython's help topics (the built-in text),
    with an end-of-text token and a ChatML chat template: real tokenization for tiny test models and
    synthetic benchmarks, without a model download. Deterministic for a given vocab_size."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([topics[k] for k in sorted(topics)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


def write_random(
    out: Path,
    model_type: str,
    tokenizer_dir: Path,
    *,
    layers: int = 2,
    shards: int = 1,
    seed: int = 0,
    outlier: float = 8.0,
    init_bf16: bool = False,
    **config,
) -> Path:
    """A random model of a registered family, from transformers' own config class with the adapter's
    `tiny` sizes (overridden by **config), bf16, saved with save_pretrained (so on disk as the family's
    checkpoints are: per-expert tensors for MoE models), with the tokenizer. One residual channel gets
    a large pre-attention norm weight (an activation outlier, as real LLMs have). Any other model_type
    transformers knows: its config class with **config applied to the (text) config, multimodal
    checkpoints through their image-text-to-text class."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from fp8ptq.models.arch import ARCHS

    arch = ARCHS.get(model_type)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
    ids = {f"{k}_token_id": getattr(tok, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}  # hashable in test fixtures
    sizes = {**ids, "num_hidden_layers": layers, "vocab_size": len(tok), **config}
    if arch is not None:
        cfg = AutoConfig.for_model(model_type, **{**arch.tiny, **sizes})
    else:
        default = AutoConfig.for_model(model_type)
        if default.get_text_config() is default:
            cfg = AutoConfig.for_model(model_type, **sizes)
        else:  # multimodal: the sizes are the language model's; the tower is shrunk too
            cfg = AutoConfig.for_model(model_type, text_config=sizes, **ids)
            _shrink_tower(cfg)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if init_bf16 else None  # large benchmark models: never a full fp32 copy
    try:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    except ValueError:  # an image-text-to-text model type only
        model = AutoModelForImageTextToText.from_config(cfg, dtype=dtype)
    model = model.to(torch.bfloat16)
    if arch is not None:
        with torch.no_grad():
            for layer in arch.decoder_layers(model):
                norm = layer.get_submodule(arch.blocks[0].norm).weight
                norm[3] = outlier - arch.norm_offset
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(str(out), max_shard_size=max(total // shards + 1, 1 << 16) if shards > 1 else "10GB")
    tok.save_pretrained(str(out))
    return Path(out)


def add_mtp_layer(model_dir: Path, seed: int = 0, *, reads_hidden: bool = False) -> Path:
    """Give a single-file DeepSeek-style checkpoint (DeepSeek-V3, GLM-4.5) one multi-token-prediction layer
    as those checkpoints store it: decoder layer `num_hidden_layers` (a copy of the last layer's tensors)
    plus its `eh_proj`, `enorm`, `hnorm` and `shared_head.norm` (weights drawn in [0.9, 1.1): trained norms
    are not all ones, and a norm applied twice or skipped then changes some drafts), and `num_nextn_predict_layers` 1 in
    config.json. eh_proj is random, or with `reads_hidden` [0 | I]: the layer reads only the target's hidden
    state, so its first draft is near the target's own last prediction (a random target that repeats itself
    accepts many of them: acceptance to compare between engines). transformers does not build the layer;
    vLLM's `method: mtp` and fp8ptq's spec/mtp.py run it."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (shard,) = sorted(model_dir.glob("*.safetensors"))
    tensors = load_file(str(shard))
    last, new = f"model.layers.{config['num_hidden_layers'] - 1}.", f"model.layers.{config['num_hidden_layers']}."
    layer = {new + k[len(last) :]: v.clone() for k, v in tensors.items() if k.startswith(last)}
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    eh = torch.randn(hidden, 2 * hidden, generator=g) * 0.02
    if reads_hidden:
        eh = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], 1)
    layer[new + "eh_proj.weight"] = eh.to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        layer[new + f"{norm}.weight"] = (0.9 + 0.2 * torch.rand(hidden, generator=g)).to(torch.bfloat16)
    save_file({**tensors, **layer}, str(shard), metadata={"format": "pt"})
    (model_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}, indent=2) + "\n")
    return model_dir


def _shrink_tower(cfg) -> None:
    """A multimodal config's vision tower at test size (one layer, 64 wide) instead of its default
    (SigLIP-400M: ~800 MB per checkpoint copy), keeping what it must agree with (the text width)."""
    vision = getattr(cfg, "vision_config", None)
    if vision is None:
        return
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, depth=1, num_attention_heads=4)
    small |= dict(num_heads=4, out_hidden_size=cfg.get_text_config().hidden_size)
    for key, value in small.items():
        if hasattr(vision, key):
            setattr(vision, key, value)
    # a config that derives the MLP width from `mlp_ratio` when built (Step3p5's tower) would load back
    # wider than the tensors it saved: the ratio follows the width set here
    width = getattr(vision, "intermediate_size", None)
    if width is not None and hasattr(vision, "mlp_ratio"):
        if type(vision).from_dict(vision.to_dict()).intermediate_size != width:
            vision.mlp_ratio = width / vision.hidden_size


# a ChatML template whose message content may be a list of {"type": "image"} / {"type": "text"} parts
VLM_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_random_vlm(
    out: Path, tokenizer_dir: Path, model_type: str = "idefics3", *, layers: int = 2, seed: int = 0, **text
) -> Path:
    """A random image-text model with its processor: 64-pixel images (one tile) that take 4 image tokens,
    PIL image processors (no torchvision), the tokenizer's ChatML template taking image parts.
    `idefics3`: SmolVLM's layout (SigLIP tower, pixel-shuffle connector, Llama decoder); `gemma3`: Gemma 3's
    (SigLIP tower, pooling projector, Gemma 3 decoder with bidirectional attention inside an image).
    **text: the decoder's config (vocab_size and token ids come from the tokenizer)."""
    import transformers as tf

    size, patch = 64, 16
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    vision |= dict(image_size=size, patch_size=patch)
    if model_type == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as Images

        tok = tf.AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False)
        tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>", "<global-img>"]})
        edge = {"longest_edge": size}
        images = Images(size=edge, max_image_size=edge, do_image_splitting=False)
        template = VLM_TEMPLATE
        processor = tf.Idefics3Processor(images, tok, image_seq_len=4, chat_template=template)
        top = dict(scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"))
        config, model_cls = tf.Idefics3Config, tf.Idefics3ForConditionalGeneration
    elif model_type == "gemma3":
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil as Images

        marks = dict(boi_token="<start_of_image>", image_token="<image_soft_token>", eoi_token="<end_of_image>")
        tok = tf.AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=False, extra_special_tokens=marks)
        template = VLM_TEMPLATE.replace("<image>", marks["boi_token"])
        processor = tf.Gemma3Processor(Images(size={"height": size, "width": size}), tok, template, image_seq_length=4)
        ids = {k: tok.convert_tokens_to_ids(v) for k, v in marks.items()}
        top = dict(mm_tokens_per_image=4, image_token_index=ids["image_token"])
        top |= dict(boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"])
        text = {"query_pre_attn_scalar": text.get("head_dim", 32), **text}
        config, model_cls = tf.Gemma3Config, tf.Gemma3ForConditionalGeneration
    else:
        raise ValueError(f"write_random_vlm: no processor recipe for '{model_type}' (idefics3, gemma3)")
    ids = {f"{k}_token_id": getattr(tok, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    cfg = config(
        text_config={**ids, "num_hidden_layers": layers, "vocab_size": len(tok), **text},
        vision_config=vision,
        pad_token_id=tok.pad_token_id,
        **top,
    )
    torch.manual_seed(seed)
    model_cls(cfg).to(torch.bfloat16).save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return Path(out)


def write_images(out: Path, n: int, seed: int = 0) -> Path:
    """n random RGB images (48 x 80 pixels) and `images.jsonl` pairing each with a text line (--images)."""
    import numpy as np
    from PIL import Image

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)).save(out / f"image{i}.png")
        lines.append(json.dumps({"image": f"image{i}.png", "text": f"Describe picture {i} in one sentence."}))
    (out / "images.jsonl").write_text("\n".join(lines) + "\n")
    return out / "images.jsonl"
