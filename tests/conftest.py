"""Shared fixtures: the real demo model (converted once into the fp8ptq cache) and tiny random models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF bf16 directory (the built-in alias, converted from GGUF once)."""
    from fp8ptq.models import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def smol_kv8(tmp_path_factory):
    """The real model quantized with fp8-kv8 (small calibration): (output dir, manifest). Do not modify it."""
    from fp8ptq.jobs import QuantizeConfig, quantize

    out = tmp_path_factory.mktemp("real") / "smol-fp8-kv8"
    manifest = quantize(QuantizeConfig(model="smollm2-135m", recipe="fp8-kv8", output=out, num_samples=8,
                                       seq_len=256, eval_samples=2, eval_seq_len=256))
    return out, manifest


def make_tiny_llama(out: Path, tokenizer_dir: Path, layers: int = 2, shards: int = 1, seed: int = 0,
                    hidden: int = 64, intermediate: int = 128) -> Path:
    """A random Llama with the real tokenizer (so data code paths are real), saved as safetensors."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    # One outlier input channel, as real LLMs have: makes static activation scales matter.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[3] = 8.0
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(str(out), max_shard_size=max(total // shards + 1, 1 << 16) if shards > 1 else "10GB")
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smol_dir) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", smol_dir)


@pytest.fixture(scope="session")
def tiny_sharded_dir(tmp_path_factory, smol_dir) -> Path:
    d = make_tiny_llama(tmp_path_factory.mktemp("tiny_sharded") / "model", smol_dir, layers=3, shards=3, seed=1)
    assert (d / "model.safetensors.index.json").is_file()
    return d


def ct017_site() -> Path:
    return REPO / ".venv" / "ct017"


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def read_tensors(path: Path) -> dict:
    """Every tensor of a checkpoint directory, from all its safetensors shards."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out
