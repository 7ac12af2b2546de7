"""Target and draft models for the speculative harness (HF transformers, CPU or CUDA, KV cache).

The TARGET is loaded through `eval.quality.load_simulated`: for a compressed-tensors checkpoint that is
an fp32 model computing what the engine computes (quantized weights, activation and KV quantization),
so measured acceptance is the quantized target's, not its bf16 parent's. A DRAFT is a plain HF
directory (written by draft-train) or a trimmed draft (draft-trim: full-vocab embedding, an lm_head of
N kept rows, and the kept target ids), loaded in fp32 with safetensors only — or `ngram[:MIN-MAX]`, vLLM's
prompt-lookup proposer (no model: the next tokens after the longest earlier match of the context's suffix).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from fp8ptq.results import read_json
from fp8ptq.spec import SpecError

TRIM_META = "fp8ptq_trim.json"
DRAFT_META = "fp8ptq_draft.json"


@dataclass(frozen=True)
class TrimSummary:
    """draft-trim's result (fp8ptq.draft.trim); fp8ptq_trim.json in a trimmed draft, read back to load it."""

    SCHEMA: ClassVar[str] = "draft-trim"
    SCHEMA_VERSION: ClassVar[int] = 1
    draft: str
    target: str
    keep: int  # the draft's vocabulary: LM-head rows kept
    vocab: int  # the target's
    special_kept: int
    frequency_source: str
    counted_tokens: int
    coverage_counted: float  # share of the counted generated tokens the kept ids cover
    coverage_heldout: float | None  # the same on held-out generations (None: none held out)
    lm_head_rows: list[int]  # [before, after]
    lm_head_flops_saving: float
    lm_head_params: list[int]  # [before, after]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    vocab_size: int  # input vocabulary (embedding rows) = the target's token space
    kept_ids: torch.Tensor | None = None  # trimmed draft: target id of each lm_head row [N]
    label: str = ""
    source: object = None  # a target's ModelSource (load_target): its files, e.g. for its MTP layers
    method: ClassVar[str] = "draft_model"  # as a draft: vLLM's speculative method (proposers.PROPOSERS)


_NGRAM = re.compile(r"ngram(?::(\d+)-(\d+))?")


@dataclass(frozen=True)
class NgramDraft:
    """vLLM's `method: ngram` proposer (prompt lookup, vllm/v1/spec_decode/ngram_proposer.py): find the
    longest n-gram, nmin ≤ n ≤ nmax, that ends the context and occurred earlier in it (the earliest
    occurrence when several match at that length), and propose up to k of the tokens that followed it
    (fewer when the match is near the end; none when nothing matches). A deterministic proposer: at T > 0
    its q is one-hot, so exact speculative sampling accepts x with probability p(x)."""

    nmin: int = 2  # `ngram` alone means 2-4
    nmax: int = 4
    method: ClassVar[str] = "ngram"  # vLLM's speculative method (proposers.PROPOSERS)

    def propose(self, ctx: list[int], k: int) -> list[int]:
        size = len(ctx)
        for n in range(min(self.nmax, size - 1), self.nmin - 1, -1):
            suffix = ctx[size - n :]
            for j in range(size - n):
                if ctx[j : j + n] == suffix:
                    return list(ctx[j + n : j + n + k])
        return []


def parse_ngram(spec: str | Path) -> NgramDraft | None:
    """`ngram` / `ngram:MIN-MAX` → NgramDraft; anything else (a draft directory) → None."""
    m = _NGRAM.fullmatch(str(spec))
    if m is None:
        return None
    if m.group(1) is None:
        return NgramDraft()
    nmin, nmax = int(m.group(1)), int(m.group(2))
    if not 1 <= nmin <= nmax:
        raise SpecError(f"n-gram sizes '{spec}' must satisfy 1 ≤ MIN ≤ MAX", fix="e.g. ngram:2-4")
    return NgramDraft(nmin, nmax)


def load_target(spec: str | Path, device: str = "cpu") -> tuple[LoadedModel, object]:
    """(target under simulated engine numerics, its ModelSource)."""
    from fp8ptq.models.loader import resolve_model

    src = resolve_model(str(spec))
    return LoadedModel(_simulated_or_plain(src, device), int(src.config.vocab_size), None, src.label, src), src


def _simulated_or_plain(src, device: str) -> torch.nn.Module:
    """Quantized checkpoint: the simulated-numerics model. Plain one: the HF model in fp32 (nothing to
    simulate; also keeps compressed-tensors out of the import path, e.g. on a bare GPU machine)."""
    if getattr(src.config, "quantization_config", None) is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(src.path),
            dtype=torch.float32,
            attn_implementation="sdpa",
            trust_remote_code=False,
            use_safetensors=True,
        )
        return model.to(device).eval()
    from fp8ptq.eval.quality import load_simulated  # registers fp8ptq's attention and its mask builder

    return load_simulated(src, simulate=True, device=device).model


def load_draft(path: str | Path, device: str = "cpu") -> LoadedModel:
    """A draft directory: plain HF (full vocabulary) or trimmed (has fp8ptq_trim.json); or `ngram[:MIN-MAX]`."""
    from fp8ptq.models.loader import resolve_model

    ngram = parse_ngram(path)
    if ngram is not None:
        return ngram
    path = Path(path)
    src = resolve_model(str(path))  # validates config + safetensors, refuses pickles
    if (path / TRIM_META).is_file():
        return _load_trimmed(src, device)
    return LoadedModel(_simulated_or_plain(src, device), int(src.config.vocab_size), None, str(path))


def _load_trimmed(src, device: str) -> LoadedModel:
    from fp8ptq.models.skeleton import build_skeleton

    meta = read_json(src.path / TRIM_META, TrimSummary, error=SpecError, fix="trim the draft again (fp8ptq draft-trim)")
    model = build_skeleton(src.config)
    hidden = model.config.hidden_size
    kept = src.tensor("d2t").long() + torch.arange(meta.keep)  # target id = draft id + d2t[draft id]
    with torch.device("meta"):
        model.lm_head = torch.nn.Linear(hidden, meta.keep, bias=False)
    state = {n: src.tensor(n).float() for n, _ in model.named_parameters()}
    model.load_state_dict(state, strict=True, assign=True)
    return LoadedModel(model.to(device).eval(), int(src.config.vocab_size), kept.to(device), str(src.path))


def crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers Cache (5.x: crop(-n) removes n); None: no-op."""
    if cache is None:
        return
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def new_cache(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.inference_mode()
def step_logits(m: LoadedModel, ids: list[int], cache, device: str = "cpu") -> torch.Tensor:
    """Feed `ids` after what the cache holds; logits [len(ids), V_out] in fp32 (V_out = N when trimmed)."""
    x = torch.tensor([ids], dtype=torch.long, device=device)
    return m.model(input_ids=x, past_key_values=cache, use_cache=True).logits[0].float()


def to_target_probs(m: LoadedModel, probs: torch.Tensor, vocab: int) -> torch.Tensor:
    """A trimmed draft's distribution over its N rows, scattered into the target vocabulary (0 elsewhere:
    still exact speculative sampling, the residual covers the tokens the draft cannot propose)."""
    if m.kept_ids is None:
        return probs
    full = probs.new_zeros(*probs.shape[:-1], vocab)
    full[..., m.kept_ids] = probs
    return full
