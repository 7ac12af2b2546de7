"""Multi-token prediction (MTP): the draft is the target's own MTP layer, run the way vLLM 0.32's
`method: mtp` runs it (model_executor/models/deepseek_mtp.py, glm4_moe_mtp.py; the loop in
v1/spec_decode/llm_base_proposer.py). DeepSeek-V3 and GLM-4.5 store that layer as decoder layer
`num_hidden_layers` (`model.layers.61` for DeepSeek-V3) with four more tensors; fp8ptq's exports carry it
float (export/writer.py), and here it is read from the target's own files:

    e      = embed(token t + 1), zero at position 0          # the target's embedding (vLLM shares it)
    x      = eh_proj(cat(enorm(e), hnorm(h_t)))              # h_t: the target's hidden at t AFTER its final norm
    out    = decoder_layer(x) at position t                  # the target's decoder-layer class, own KV cache
    logits = lm_head(shared_head.norm(out))                  # the target's LM head (vLLM always shares it)

Draft steps 2..γ feed the drafted token at the next position with the previous step's hidden state:
DeepSeek recycles shared_head.norm(out) (vLLM's DeepSeekMTPModel returns both, "matches SGLang's
deepseek_nextn"), GLM-4.5 recycles `out` (Glm4MoeMTPModel returns one tensor). vLLM 0.32's proposer never
passes spec_step_idx, so every draft step runs the first MTP layer, also where a checkpoint ships more.
The first pass over the verified positions, the KV bookkeeping and the replay are eagle3_loop's
(`MtpProposer`, at the end, is a proposer_base.TargetHiddenProposer).
The layer runs in fp32 with a float KV cache: a KV-quantized export's MTP layer has no KV scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from fp8ptq.spec import SpecError
from fp8ptq.spec.eagle3 import RMSNorm
from fp8ptq.spec.models import LoadedModel, crop
from fp8ptq.spec.proposer_base import TargetHiddenProposer

# model_type -> whether a draft step after the first gets shared_head.norm(out) (True) or out (False)
RECYCLES_NORMED = {"deepseek_v3": True, "glm4_moe": False}
MTP_TENSORS = ("enorm", "hnorm", "eh_proj", "shared_head.norm")  # beside the decoder layer's own
QUANTIZED_SUFFIXES = (".weight_scale", ".weight_packed")  # compressed-tensors' quantized Linears


class MtpModule(nn.Module):
    """One MTP layer on top of the target's embedding, rotary embedding and LM head (not owned: `target`)."""

    def __init__(self, layer: nn.Module, config, recycle_normed: bool, target: nn.Module, rotary: nn.Module):
        super().__init__()
        hidden, eps = int(config.hidden_size), float(getattr(config, "rms_norm_eps", 1e-6))
        self.enorm, self.hnorm, self.shared_norm = RMSNorm(hidden, eps), RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer, self.config, self.recycle_normed, self.hidden = layer, config, recycle_normed, hidden
        self._target = (target, rotary)  # a tuple: not submodules (their weights are the target's)

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache):
        """tokens [B, T] (the token after each position), hidden [B, T, H], positions [T], after what
        `cache` holds. Returns (logits [B, T, V] fp32, the hidden state the next draft step reads)."""
        target, rotary = self._target
        e = target.get_input_embeddings()(tokens).float()
        e = torch.where(positions.view(1, -1, 1) == 0, 0.0, e)  # vLLM: "masking inputs at position 0"
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.float())], -1))
        T, S = x.shape[1], cache.get_seq_length() + x.shape[1]
        mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(S - T)[None, None]
        out = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions.view(1, -1),
            cache=cache,
            use_cache=True,
            position_embeddings=rotary(x, positions.view(1, -1)),
        )
        normed = self.shared_norm(out)
        logits = target.get_output_embeddings()(normed).float()
        return logits, normed if self.recycle_normed else out


@dataclass
class MtpDraft:
    """The target's MTP layer, loaded: what proposers.MtpProposer drafts with."""

    module: MtpModule
    vocab_size: int
    final_norm: str  # the target's final norm (module path): what the layer reads comes out of it
    label: str = ""
    method: ClassVar[str] = "mtp"  # vLLM's speculative method (proposers.PROPOSERS)


def mtp_layers(src) -> list[str]:
    """The MTP layer prefixes a checkpoint holds (models/tensors.layers_past)."""
    from fp8ptq.models.tensors import layers_past

    return layers_past(src.weight_map, src.arch.layers, src.text_config)


def load_mtp(target: LoadedModel, device: str = "cpu") -> MtpDraft:
    """The first MTP layer of the loaded target's checkpoint, fp32 (SpecError where it has none, or a family
    whose MTP layout fp8ptq does not run)."""
    from fp8ptq.models.skeleton import materialize, plain_config

    src = target.source
    cfg = src.text_config
    where = f"'{src.path}' ({cfg.model_type})"
    prefixes = mtp_layers(src)
    if not prefixes or not all(src.has(f"{prefixes[0]}.{t}.weight") for t in MTP_TENSORS):
        raise SpecError(
            f"{where} holds no MTP layer (decoder layer {cfg.num_hidden_layers} with {', '.join(MTP_TENSORS)})",
            fix="use the checkpoint that ships its MTP layers (num_nextn_predict_layers), or another draft",
        )
    if cfg.model_type not in RECYCLES_NORMED:
        raise SpecError(
            f"{where}: fp8ptq runs the MTP layers of {', '.join(sorted(RECYCLES_NORMED))} only",
            fix="measure another draft (ngram, suffix, a draft model or an EAGLE-3 head)",
        )
    arch, prefix = src.arch, prefixes[0]
    packed = [n for n in src.weight_map if n.startswith(prefix + ".") and n.endswith(QUANTIZED_SUFFIXES)]
    if packed:  # fp8ptq's quantize carries the layer float; `model-free` quantizes its Linears
        raise SpecError(
            f"{where}: its MTP layer is stored quantized ('{packed[0]}'); fp8ptq's harness runs float MTP layers",
            fix="measure on the checkpoint `fp8ptq quantize` wrote (it carries the layer float) or on the source",
        )
    conf = plain_config(cfg)
    conf._attn_implementation = "sdpa"
    with torch.device("meta"):
        layer = type(arch.decoder_layers(target.model)[0])(conf, int(prefix.rsplit(".", 1)[1]))
        if arch.prepare_layer is not None:
            arch.prepare_layer(layer, conf)
    materialize(layer, prefix + ".", src, torch.float32, device)
    layer.self_attn.layer_idx = 0  # the only layer of its own cache
    rotary = target.model.get_submodule(arch.rotary)
    module = MtpModule(layer, conf, RECYCLES_NORMED[cfg.model_type], target.model, rotary)
    with torch.no_grad():
        for name, mod in (("enorm", module.enorm), ("hnorm", module.hnorm), ("shared_head.norm", module.shared_norm)):
            mod.weight.copy_(src.tensor(f"{prefix}.{name}.weight").float())
        module.eh_proj.weight.copy_(src.tensor(f"{prefix}.eh_proj.weight").float())
    return MtpDraft(module.to(device).eval(), target.vocab_size, arch.final_norm, f"{src.path} {prefix}")


class FinalHidden:
    """Context manager: records the target's hidden states after its final norm (what vLLM hands an MTP
    layer) during forwards; take() -> [B, T, H] fp32. `reads_input`: what the named module reads instead
    of what it returns (the EAGLE-3 trainer's LM-head input where it cannot name the final norm)."""

    def __init__(self, model: nn.Module, final_norm: str, reads_input: bool = False):
        self.norm, self.handle, self.seen = model.get_submodule(final_norm), None, None
        self.reads_input = reads_input

    def __enter__(self):
        if self.reads_input:
            self.handle = self.norm.register_forward_pre_hook(lambda m, args: self._hook(m, args, args[0]))
        else:
            self.handle = self.norm.register_forward_hook(self._hook)
        return self

    def _hook(self, module, args, output):
        self.seen = output.detach()

    def take(self) -> torch.Tensor:
        out, self.seen = self.seen.float(), None
        return out

    def __exit__(self, *exc):
        self.handle.remove()


class MtpState:
    """The MTP layer's KV cache: `committed` positions computed from target hidden states (kept)."""

    def __init__(self, module: MtpModule):
        from fp8ptq.spec.models import new_cache

        self.cache, self.committed = new_cache(module), 0


@torch.inference_mode()
def propose(draft: MtpDraft, st: MtpState, seq: list[int], aux: torch.Tensor, *, gamma, temperature, g, threshold):
    """seq: tokens so far (the target verified positions 0..len(seq)-2; aux holds their final hidden rows
    from st.committed on). Returns (drafted ids, q rows): eagle3_loop.propose with this layer."""
    from fp8ptq.spec.steps import draft_chain, pick_token

    m, dev = draft.module, aux.device
    base, start = len(seq), st.committed
    pos = torch.arange(start, base - 1, device=dev)
    logits, hidden = m.step(torch.tensor([seq[start + 1 : base]], device=dev), aux[None], pos, st.cache)
    st.committed = base - 1
    hidden = hidden[:, -1:]

    def step(tok, k):  # drafted token k sits at position base - 1 + k; its KV entries are speculative
        nonlocal hidden
        logits, hidden = m.step(
            torch.tensor([[tok]], device=dev), hidden, torch.tensor([base - 1 + k], device=dev), st.cache
        )
        return logits[0, -1]

    drafted, q_rows = draft_chain(logits[0, -1], gamma, threshold, lambda x: pick_token(x, temperature, g), step)
    crop(st.cache, st.committed)  # drop the speculative entries
    return drafted, q_rows


@torch.inference_mode()
def mtp_step_time(target: LoadedModel, draft: MtpDraft, context: list[int], repeats: int, device: str, batch: int = 1):
    """Median wall time of one MTP step (1 token after a cache of len(context) - 1 positions), for `batch`
    sequences at once."""
    from fp8ptq.spec.steps import median_time

    m = draft.module
    with FinalHidden(target.model, draft.final_norm) as cap:
        target.model(input_ids=torch.tensor([context], device=device))
        aux = cap.take()
    st = MtpState(m)
    n = len(context) - 1
    toks = torch.tensor([context[1:]] * batch, device=device)
    m.step(toks, aux[:, :n].expand(batch, -1, -1), torch.arange(n, device=device), st.cache)
    tok, h = toks[:, -1:], torch.zeros(batch, 1, m.hidden, device=device)
    pos = torch.tensor([n], device=device)

    def f():
        m.step(tok, h, pos, st.cache)
        crop(st.cache, n)

    return median_time(f, repeats)


class MtpProposer(TargetHiddenProposer):
    """vLLM's `method: mtp`: the target's own multi-token-prediction layer (`mtp.py`), on its final hidden
    states. The DRAFT argument is `mtp`; the layer is read from the target's files."""

    method = "mtp"
    # SGLang 0.5.23's NEXTN (its EAGLE worker) takes the draft from the target's own path for these classes
    sglang_algorithm, sglang_draft_path = "NEXTN", False
    model_free = True  # no draft to size: its weights are in the target's files (and counted there)

    @classmethod
    def claims(cls, draft) -> bool:
        return str(draft) == cls.method

    @classmethod
    def load(cls, draft, target=None, device="cpu"):
        if target is None or target.source is None:
            raise SpecError("the MTP draft runs on its target's own layers", fix="load the target first")
        return load_mtp(target, device)

    @classmethod
    def vllm_config(cls, draft, gamma):
        """No draft model: vLLM reads the layer from the target's checkpoint (num_nextn_predict_layers)."""
        return {"method": "mtp", "num_speculative_tokens": gamma}

    def check(self, target):
        pass  # the target's own embedding and LM head

    def capture(self, model):
        return FinalHidden(model, self.draft.final_norm)

    def new_state(self):
        return MtpState(self.draft.module)

    def propose(self, seq, *, gamma, temperature, threshold, g):
        aux = self.rows(seq)
        return propose(self.draft, self.state, seq, aux, gamma=gamma, temperature=temperature, g=g, threshold=threshold)

    def step_time(self, target, context, *, max_k, repeats, device, batch=1):
        return mtp_step_time(target, self.draft, context, repeats, device, batch)
