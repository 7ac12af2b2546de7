"""An independent implementation of FP8 engine numerics, written only for the tests.

Weights come from transformers' own compressed-tensors loader (not fp8ptq's); inputs and keys/values
are fake-quantized by the few lines below with the scales read straight from the safetensors files.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open


def _raw(path: Path) -> dict:
    out = {}
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys() if k.endswith(("input_scale", "k_scale", "v_scale"))})
    return out


def _fq(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)) * s


def load_plain(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def load_fake_quant(path: Path):
    """Plain HF load + static FP8 input quantization + FP8 KV via a test-only attention function."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scales = _raw(path)
    model = load_plain(path)
    for name, module in model.named_modules():
        if f"{name}.input_scale" in scales:
            s = scales[f"{name}.input_scale"].float()
            module.register_forward_pre_hook(lambda m, a, s=s: (_fq(a[0], s),))
        if f"{name}.k_scale" in scales:
            module.test_kv = (scales[f"{name}.k_scale"].float(), scales[f"{name}.v_scale"].float())

    def test_kv_attention(module, q, k, v, mask, **kw):
        ks, vs = module.test_kv
        return sdpa_attention_forward(module, q, _fq(k, ks), _fq(v, vs), mask, **kw)

    AttentionInterface.register("test_kv_attention", test_kv_attention)
    model.set_attn_implementation("test_kv_attention")
    return model


@torch.inference_mode()
def kl_top1_ppl(ref, cand, ids: torch.Tensor) -> dict:
    lr = F.log_softmax(ref(ids).logits.float()[:, :-1], -1)
    lc = F.log_softmax(cand(ids).logits.float()[:, :-1], -1)
    t = ids[:, 1:].unsqueeze(-1)
    n = t.numel()
    return {
        "kl": float((lr.exp() * (lr - lc)).sum()) / n,
        "top1": float((lr.argmax(-1) == lc.argmax(-1)).float().mean()),
        "ppl": math.exp(-float(lc.gather(-1, t).sum()) / n),
    }
