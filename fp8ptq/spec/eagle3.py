"""EAGLE-3 draft head: the module, its exact vLLM 0.32 checkpoint layout, and loading it back.

The head computes what vLLM 0.32's `Eagle3LlamaForCausalLM` (vllm/model_executor/models/llama_eagle3.py)
computes, with its flags no norm_before_fc, norm_before_residual False, norm_output False, and fc_norm as
the head says (True for heads fp8ptq trains: one RMSNorm per aux layer, vLLM's "Eagle 3.1" option), in the
same tensor names (docs/speculative.md, "EAGLE-3 heads"):

    g      = fc(cat(n_0(aux_0), n_1(aux_1), n_2(aux_2)))   # residual streams at eagle_aux_hidden_state_layer_ids;
                                                           # n_j = fc_norm.j (RMSNorm), or identity without fc_norm
    x      = cat(input_layernorm(embed(token)), hidden_norm(g))           # [.., 2H]: the attention input
    r      = o_proj(attn(q/k/v_proj(x))) + g                              # residual = g (norm after residual)
    out    = mlp(post_attention_layernorm(r)) + r                         # pre-norm output, fed to the next step
    logits = lm_head(norm(out))                                           # over the draft vocabulary (d2t maps)

At draft step k ≥ 1 the hidden input is the previous step's `out` (not fc again): vLLM's proposer
passes the model's second return value (`hidden_prenorm`) back in. The embedding is the target's own
(frozen; not exported, so vLLM shares the target's embed_tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fp8ptq.spec import SpecError

EAGLE3_META = "fp8ptq_eagle3.json"
ARCH = "LlamaForCausalLMEagle3"  # vLLM 0.32 registry: llama_eagle3.Eagle3LlamaForCausalLM


def default_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default (interfaces.py get_eagle3_default_aux_hidden_state_layers) and the speculators one."""
    return [2, num_layers // 2, num_layers - 3]


# SGLang 0.5.23 reads a head's eagle_config ids, and for these targets' model classes captures the input
# of layer id + 1 (`layers_to_capture = [val + 1 ...]` in set_eagle3_layers_to_capture: models/llama.py,
# whose LlamaForCausalLM Mistral and Phi-3 inherit, qwen2.py, qwen3.py, gemma3_causal.py); vLLM 0.32 reads
# the top-level ids and captures the input of layer id. eagle_config carries the ids less one, so both
# engines feed the head the layers it was trained on (tests/engine/test_sglang_args.py runs SGLang's rule).
SGLANG_CAPTURES_NEXT = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma3_text")


def sglang_layer_ids(model_type: str | None, ids: list[int]) -> list[int]:
    """The eagle_config ids that make SGLang capture what vLLM captures for `ids` (unchanged for other
    families, and where an id is 0: the embeddings, which SGLang's rule cannot name)."""
    if model_type in SGLANG_CAPTURES_NEXT and min(ids) >= 1:
        return [i - 1 for i in ids]
    return list(ids)


def check_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    ids = sorted(set(int(i) for i in ids))
    if len(ids) < 1 or any(not 0 <= i <= num_layers for i in ids):
        raise SpecError(
            f"EAGLE-3 layer ids {ids} are out of range for a target with {num_layers} layers",
            fix=f"pass distinct ids in 0..{num_layers} (id i = the residual stream entering layer i)",
        )
    return ids  # vLLM sorts them (EagleModelMixin._set_aux_hidden_state_layers): fc's input order


@dataclass
class HeadShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    vocab: int
    draft_vocab: int
    layer_ids: list[int]
    fc_norm: bool = False  # an RMSNorm per aux layer before fc (vLLM config `fc_norm`)


def shape_from_target(config, layer_ids: list[int], draft_vocab: int, fc_norm: bool = False) -> HeadShape:
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    return HeadShape(
        hidden=hidden,
        intermediate=int(config.intermediate_size),
        heads=heads,
        kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
        eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        vocab=int(config.vocab_size),
        draft_vocab=int(draft_vocab),
        layer_ids=list(layer_ids),
        fc_norm=bool(fc_norm),
    )


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(2 * s.hidden, s.heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * s.hidden, s.kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)

    def qkv(self, x, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.s.heads, self.s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.s.kv_heads, self.s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.s.kv_heads, self.s.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def attend(self, q, k, v, mask):
        """q [B, h, T, d], k/v [B, kv, S, d], mask [T, S] bool (True = attend) or None (causal, T == S)."""
        rep = self.s.heads // self.s.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, s: HeadShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.hidden_norm = RMSNorm(s.hidden, s.eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s)


class Eagle3Head(nn.Module):
    """The head. `rotary` is the target's rotary embedding class instance (same RoPE as the target)."""

    def __init__(self, s: HeadShape, rotary: nn.Module):
        super().__init__()
        self.s = s
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(len(s.layer_ids) * s.hidden, s.hidden, bias=False)
        # The target's residual streams carry a few huge channels whose size grows with depth: normalising each
        # aux layer keeps fc's input (and AdamW's per-weight steps) on one scale.
        self.fc_norm = nn.ModuleList([RMSNorm(s.hidden, s.eps) for _ in s.layer_ids]) if s.fc_norm else None
        self.midlayer = MidLayer(s)
        self.norm = RMSNorm(s.hidden, s.eps)
        self.lm_head = nn.Linear(s.hidden, s.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(s.vocab, dtype=torch.bool))
        self.rotary = rotary

    # -- the mapping between the two vocabularies
    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def set_vocab(self, kept: torch.Tensor) -> None:
        """kept: the target ids of the lm_head rows, ascending (the d2t / t2d convention)."""
        kept = kept.long().to(self.d2t.device)
        self.d2t.copy_(kept - torch.arange(kept.numel(), device=kept.device))
        self.t2d.zero_()
        self.t2d[kept] = True

    # -- one layer over a block of positions
    def block(self, tokens, hidden, positions, past=None, mask=None, logits: bool = True):
        """tokens [B, T] (target ids), hidden [B, T, H] (fc output or a previous step's `out`), positions
        [T]; past: (k, v) of earlier positions or None. Returns (out [B, T, H], logits [B, T, N] or None
        without `logits`, (k, v) of this block)."""
        layer = self.midlayer
        emb = self.embed_tokens(tokens).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], -1)
        cos, sin = self.rotary(hidden, positions.view(1, -1))
        q, k, v = layer.self_attn.qkv(x, cos, sin)
        if past is not None:
            kk, vv = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
            S, T = kk.shape[2], k.shape[2]
            if mask is None:  # new positions see all of past + causal among themselves
                mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        else:
            kk, vv = k, v
        r = layer.self_attn.attend(q, kk, vv, mask) + hidden
        out = layer.mlp(layer.post_attention_layernorm(r)) + r
        return out, self.lm_head(self.norm(out)) if logits else None, (k, v)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [.., n·H] (the aux layers' residual streams, concatenated in id order) -> g [.., H]."""
        return self.fc(self.fc_input(aux))

    def fc_input(self, aux: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is None:
            return aux
        return torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)


def build_head(target_model, layer_ids: list[int], draft_vocab: int, fc_norm: bool = False) -> Eagle3Head:
    """A fresh head for `target_model` (an HF causal LM): its shapes, its RoPE, its embedding (frozen copy)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = target_model.config
    s = shape_from_target(cfg, check_layer_ids(layer_ids, int(cfg.num_hidden_layers)), draft_vocab, fc_norm)
    rotary = LlamaRotaryEmbedding(config=cfg)
    head = Eagle3Head(s, rotary)
    with torch.no_grad():
        emb = target_model.get_input_embeddings().weight
        head.embed_tokens.weight.copy_(emb.detach().float().to(head.embed_tokens.weight.device))
        torch.manual_seed(0)
        for m in head.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
        lm = target_model.get_output_embeddings()
        if lm is not None and draft_vocab == s.vocab:
            head.lm_head.weight.copy_(lm.weight.detach().float())
        final = target_final_norm(target_model, s.hidden)
        if final is not None:  # the LM-head rows are the target's: read them through the target's norm
            head.norm.weight.copy_(final)
    return head


def target_final_norm(target_model, hidden: int) -> torch.Tensor | None:
    """The weight of the target's final norm when its RMSNorm computes weight · x / rms(x) (not Gemma's
    (1 + weight)): the adapter says so, the generic path probes the norm (models/arch/capture.py); None
    for a model fp8ptq cannot read, or another shape."""
    from fp8ptq.errors import Fp8ptqError
    from fp8ptq.models.arch import arch_for
    from fp8ptq.models.arch.capture import norm_offset
    from fp8ptq.models.arch.generic import GenericArch

    try:
        arch = arch_for(target_model.config)
        norm = target_model.get_submodule(arch.final_norm)
        w = norm.weight
    except (Fp8ptqError, AttributeError):
        return None
    offset = norm_offset(norm) if isinstance(arch, GenericArch) else arch.norm_offset
    return w.detach().float().cpu() if offset == 0.0 and tuple(w.shape) == (hidden,) else None


def init_lm_head(head: Eagle3Head, target_model, kept: torch.Tensor) -> None:
    """Trimmed vocabulary: the lm_head starts as the target's LM-head rows of the kept ids."""
    head.set_vocab(kept)
    lm = target_model.get_output_embeddings()
    if lm is not None:
        with torch.no_grad():
            head.lm_head.weight.copy_(lm.weight.detach()[kept.to(lm.weight.device)].float())


# ---------------------------------------------------------------- export / load


def export_config(target_config_json: dict, s: HeadShape) -> dict:
    """config.json vLLM 0.32 reads for method eagle3: the target's own config (its RoPE, eps, head_dim) made
    a one-layer LlamaForCausalLMEagle3 with draft_vocab_size, target_hidden_size and the aux layer ids."""
    cfg = {k: v for k, v in target_config_json.items() if k not in ("quantization_config", "auto_map", "_name_or_path")}
    sglang_ids = sglang_layer_ids(target_config_json.get("model_type"), list(s.layer_ids))
    cfg.update(
        architectures=[ARCH],
        model_type="llama",
        num_hidden_layers=1,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        vocab_size=s.vocab,
        draft_vocab_size=s.draft_vocab,
        target_hidden_size=s.hidden,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        eagle_aux_hidden_state_layer_ids=list(s.layer_ids),
        eagle_config={"eagle_aux_hidden_state_layer_ids": sglang_ids, "use_aux_hidden_state": True},  # SGLang's
        fc_norm=s.fc_norm,
    )
    cfg.pop("layer_types", None)
    cfg.pop("dtype", None)
    return cfg


def export_state(head: Eagle3Head, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Tensor names vLLM's Eagle3LlamaForCausalLM.load_weights maps (midlayer.* -> model.layers.0.*); no
    embed_tokens (vLLM then shares the target's); d2t / t2d only for a trimmed vocabulary."""
    out = {}
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        out[name] = p.detach().to(dtype).contiguous()
    if head.s.draft_vocab != head.s.vocab:
        out["d2t"] = head.d2t.detach().cpu().contiguous()
        out["t2d"] = head.t2d.detach().cpu().contiguous()
    return {k: v.cpu() for k, v in out.items()}


def is_eagle3(path: str | Path) -> bool:
    p = Path(str(path)) / "config.json"
    if not p.is_file():
        return False
    try:
        archs = json.loads(p.read_text()).get("architectures") or []
    except ValueError:
        return False
    return any("Eagle3" in a for a in archs)


def load_head(path: str | Path, target_model, device: str = "cpu") -> Eagle3Head:
    """An exported head (safetensors only) on top of `target_model` (its embedding and RoPE), fp32."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )  # vLLM's order of reading; fp8ptq's own heads carry the top-level ids (eagle_config's are SGLang's)
    tcfg = target_model.config
    if int(cfg["vocab_size"]) != int(tcfg.vocab_size) or int(cfg["hidden_size"]) != int(tcfg.hidden_size):
        raise SpecError(
            f"EAGLE-3 head '{path}' (vocab {cfg['vocab_size']}, hidden {cfg['hidden_size']}) does not fit the target "
            f"(vocab {tcfg.vocab_size}, hidden {tcfg.hidden_size})",
            fix="use a head trained for this target (fp8ptq draft-train TARGET --kind eagle3)",
        )
    ids = ids or default_layer_ids(int(tcfg.num_hidden_layers))
    head = build_head(
        target_model, ids, int(cfg.get("draft_vocab_size") or cfg["vocab_size"]), bool(cfg.get("fc_norm", False))
    )
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise SpecError(f"EAGLE-3 head '{path}' has no .safetensors weights", fix="point at a draft-train output")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing = [n for n, _ in head.named_parameters() if n not in state and not n.startswith("embed_tokens")]
    if missing:
        raise SpecError(f"EAGLE-3 head '{path}' lacks tensors {missing[:4]}", fix="re-export it with fp8ptq")
    with torch.no_grad():
        for n, p in head.named_parameters():
            if n in state:
                p.copy_(state[n].float())
        if "d2t" in state:
            head.d2t.copy_(state["d2t"].long())
            head.t2d.copy_(state["t2d"].bool())
    return head.to(device).eval()
