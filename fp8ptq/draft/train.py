"""draft-train: distil a small draft from the target on the target's own generations (FastDraft-style).

1. Data: prompts (built-in calibration-split instructions, or --prompts FILE) in the chat template; the
   TARGET (under simulated engine numerics when it is a quantized checkpoint) generates up to
   `gen_tokens` tokens for each, half of the batches greedily and half sampled at T = 1 (greedy
   contexts are what greedy serving drafts on; sampled ones add variety). At every generated position
   we keep the target's top-k next-token log-probabilities (from generate's raw logits, so the target
   never runs twice).
2. Draft: the target's config with `layers` decoder layers, initialised from the target's first
   `layers` layers + final norm + the (tied) embedding / LM head. It shares the target's tokenizer and
   vocabulary, so vLLM accepts it as `draft_model`. The embedding / LM head stays frozen (it IS the
   target's); the layers and the final norm train.
3. Loss: KL(p̃ ‖ q) at generated positions, p̃ = the target's top-k probabilities renormalised over the
   top-k (the tail mass is dropped), q = the draft's full softmax. AdamW, linear warm-up then cosine.
4. Checkpoints (safetensors: trainable weights + AdamW moments + step) every `checkpoint_every` steps
   and when the time budget ends, in a work dir beside the output (`.OUT.draft-work/`, also caching the
   generated data); `resume=True` continues from there. The batch order is a pure function of (seed,
   step), so a resumed run equals an uninterrupted one.
5. Output (atomic): an HF checkpoint in bf16 (config, model.safetensors, tokenizer), fp8ptq_draft.json
   (what was done), fp8ptq_draft_data.st (the generated token ids, reused by draft-trim).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fp8ptq.draft.config import DraftTrainConfig
from fp8ptq.draft.loop import TrainRun, TrainSummary, fit, load_checkpoint, locked_output, trainable
from fp8ptq.spec import SpecError
from fp8ptq.spec.models import DRAFT_META, LoadedModel, load_target
from fp8ptq.spec.prompts import encode_prompts, load_prompts

# Not *.safetensors: engines (vLLM) load every *.safetensors file in a model dir as weights.
DATA_FILE = "fp8ptq_draft_data.st"


@dataclass(frozen=True)
class DraftData:
    samples: int  # target generations
    generated_tokens: int
    prompt_tokens: int


@dataclass(frozen=True, kw_only=True)
class DraftSummary(TrainSummary):
    """draft-train's result; fp8ptq_draft.json in the draft's folder (without `losses`)."""

    SCHEMA: ClassVar[str] = "draft-train"
    data: DraftData
    init: str  # where the draft's weights started


def work_dir(output: Path) -> Path:
    return Path(output).parent / f".{Path(output).name}.draft-work"


def _fingerprint(cfg: DraftTrainConfig) -> dict:
    keys = ("target", "prompts", "text_field", "num_prompts", "gen_tokens", "max_prompt_tokens", "topk", "seed")
    return {k: str(getattr(cfg, k)) for k in keys}


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class Generation:
    """How the target generates a draft's training data (generate_data)."""

    gen_tokens: int  # per prompt at most
    batch_size: int  # prompts at once; odd batches sample at T = 1 (sample_odd), even ones are greedy
    topk: int  # log-probs kept per generated position; 0: tokens only
    seed: int
    device: str = "cpu"
    sample_odd: bool = True  # False: every batch greedy


@torch.inference_mode()
def generate_data(
    target: LoadedModel, tokenizer, prompts: list[list[int]], how: Generation, progress=None
) -> dict[str, torch.Tensor]:
    """Target generations + the target's top-k log-probs at each generated position.

    Returns tokens [N, L] (prompt then generation, right-padded with 0), prompt_len [N], gen_len [N]
    (generated tokens, up to and including EOS), topk_ids [N, G, k] int32, topk_logp [N, G, k] fp16:
    topk_*[i, j] is the target's distribution for generated token j of sample i. topk 0: tokens only (the
    EAGLE-3 trainer recomputes the distributions in its capture pass): generate keeps no [b, G, V] logits."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    N, G, topk, batch_size, device = len(prompts), how.gen_tokens, how.topk, how.batch_size, how.device
    L = max(len(p) for p in prompts) + G
    tokens = torch.zeros(N, L, dtype=torch.long)
    plen, glen = torch.zeros(N, dtype=torch.long), torch.zeros(N, dtype=torch.long)
    tids, tlogp = torch.zeros(N, G, topk, dtype=torch.int32), torch.full((N, G, topk), -30.0, dtype=torch.float16)
    torch.manual_seed(how.seed)
    for b, start in enumerate(range(0, N, batch_size)):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        sample = how.sample_odd and b % 2 == 1
        gen = target.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=G,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_k=0 if sample else None,
            top_p=None,
            pad_token_id=pad,
            eos_token_id=eos,
            output_logits=topk > 0,
            return_dict_in_generate=True,
        )
        new = gen.sequences[:, width:].cpu()
        if topk > 0:
            logits = torch.stack(gen.logits, 1).float()  # [b, steps, V], raw (before temperature)
            logp = torch.log_softmax(logits, -1).topk(topk, -1)
            logp = type(logp)((logp.values.cpu(), logp.indices.cpu()))
            del logits
        for r, p in enumerate(chunk):
            i = start + r
            row = new[r]
            n = row.numel()
            if eos is not None and (row == eos).any():
                n = int((row == eos).nonzero()[0]) + 1
            tokens[i, : len(p)] = torch.tensor(p)
            tokens[i, len(p) : len(p) + n] = row[:n]
            plen[i], glen[i] = len(p), n
            if topk > 0:
                tids[i, :n] = logp.indices[r, :n].int()
                tlogp[i, :n] = logp.values[r, :n].half()
        if progress:
            progress("generate", min(start + batch_size, N), N)
    return {"tokens": tokens, "prompt_len": plen, "gen_len": glen, "topk_ids": tids, "topk_logp": tlogp}


# ---------------------------------------------------------------- draft


def draft_config(target_config, layers: int):
    from fp8ptq.models.skeleton import plain_config

    cfg = plain_config(target_config)
    if not 1 <= layers <= cfg.num_hidden_layers:
        raise SpecError(
            f"--layers {layers} is out of range for a target with {cfg.num_hidden_layers} layers",
            fix=f"use 1..{cfg.num_hidden_layers} (a draft of 1-4 layers keeps c ≤ 0.25 on SmolLM2)",
        )
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    cfg.tie_word_embeddings = True
    cfg.use_cache = True
    return cfg


def init_draft(target: LoadedModel, layers: int) -> torch.nn.Module:
    """Draft = the target's first `layers` layers + final norm + embedding/LM head (tied), fp32."""
    from transformers import AutoModelForCausalLM

    from fp8ptq.models.skeleton import plain_config

    cfg = draft_config(target.model.config, layers)
    cfg._attn_implementation = "sdpa"
    draft = AutoModelForCausalLM.from_config(plain_config(cfg), dtype=torch.float32, trust_remote_code=False)
    src = target.model.state_dict()
    state = {}
    for name in draft.state_dict():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        state[name] = src[name].detach().float().clone()
    draft.load_state_dict(state, strict=False)
    draft.tie_weights()
    return draft


# ---------------------------------------------------------------- training


def batch_indices(step: int, batch: int, n: int, seed: int) -> list[int]:
    """Samples of training step `step`: consecutive slices of a per-epoch seeded permutation (pure)."""
    out, pos = [], step * batch
    while len(out) < batch:
        epoch, off = divmod(pos, n)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        take = perm[off : off + batch - len(out)].tolist()
        out += take
        pos += len(take)
    return out


def kl_loss(draft, data: dict, idx: list[int], device: str) -> torch.Tensor:
    """Mean KL(renormalised target top-k ‖ draft) over the generated positions of the batch."""
    plen, glen = data["prompt_len"][idx], data["gen_len"][idx]
    width = int((plen + glen).max())
    x = data["tokens"][idx, :width].to(device)
    attn = (torch.arange(width).unsqueeze(0) < (plen + glen).unsqueeze(1)).long().to(device)
    hidden = draft.model(input_ids=x, attention_mask=attn).last_hidden_state  # [B, W, H]
    G = data["topk_ids"].shape[1]
    j = torch.arange(G).unsqueeze(0)
    live = j < glen.unsqueeze(1)  # [B, G]
    rows, steps = live.nonzero(as_tuple=True)
    pos = plen[rows] - 1 + steps  # the input position whose output predicts generated token `steps`
    logq = F.log_softmax(draft.lm_head(hidden[rows.to(device), pos.to(device)]).float(), -1)  # [T, V]
    ids = data["topk_ids"][idx][rows, steps].long().to(device)
    logp = data["topk_logp"][idx][rows, steps].float().to(device)
    logp = logp - torch.logsumexp(logp, -1, keepdim=True)  # renormalise over the top-k
    return (logp.exp() * (logp - logq.gather(-1, ids))).sum(-1).mean()


def train(draft, data: dict, cfg: DraftTrainConfig, ckpt: Path | None, progress=None) -> TrainRun:
    """The training loop (loop.fit) on the KL loss. Resumes from `ckpt` when cfg.resume and it exists."""
    draft.model.embed_tokens.weight.requires_grad_(False)  # tied LM head: the target's, kept as is
    params = trainable(draft)
    opt = torch.optim.AdamW([p for _, p in params], lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    resumed = (0, [], 0.0)
    if cfg.resume and ckpt is not None and ckpt.is_file():
        resumed = load_checkpoint(ckpt, draft, opt, cfg.device)
    n = data["tokens"].shape[0]

    def loss_at(step: int) -> torch.Tensor:
        return kl_loss(draft, data, batch_indices(step, cfg.batch_size, n, cfg.seed), cfg.device)

    return fit(draft, opt, cfg, loss_at, ckpt=ckpt, resumed=resumed, progress=progress)


# ---------------------------------------------------------------- entry point


@locked_output
def draft_train(cfg: DraftTrainConfig, progress=None) -> DraftSummary:
    """Generate data with the target, distil the draft, write cfg.output (atomically)."""
    from fp8ptq.io import atomic_output_dir, check_output

    check_output(Path(cfg.output), cfg.overwrite, (cfg.target, cfg.prompts))
    if cfg.layers < 1 or cfg.max_steps < 0 or cfg.topk < 1 or cfg.num_prompts < 1 or cfg.gen_tokens < 1:
        raise SpecError(
            f"bad draft-train settings: layers={cfg.layers}, max_steps={cfg.max_steps}, topk={cfg.topk}, "
            f"num_prompts={cfg.num_prompts}, gen_tokens={cfg.gen_tokens}",
            fix="all must be ≥ 1 (max_steps ≥ 0)",
        )
    torch.manual_seed(cfg.seed)
    timings = {}
    t = time.perf_counter()
    target, src = load_target(cfg.target, cfg.device)
    tokenizer = src.tokenizer()
    draft_config(target.model.config, cfg.layers)  # validate before the expensive part
    work = work_dir(cfg.output)
    work.mkdir(parents=True, exist_ok=True)
    data_file, fp_file = work / "data.safetensors", work / "data.json"
    if data_file.is_file() and fp_file.is_file() and json.loads(fp_file.read_text()) == _fingerprint(cfg):
        data = load_file(str(data_file))
        timings["generate_s"] = 0.0
    else:
        texts = load_prompts(cfg.prompts, "calibration", cfg.num_prompts, cfg.seed, cfg.text_field)
        prompts = encode_prompts(tokenizer, texts, max_tokens=cfg.max_prompt_tokens)
        t = time.perf_counter()
        how = Generation(cfg.gen_tokens, cfg.gen_batch_size, cfg.topk, cfg.seed, cfg.device)
        data = generate_data(target, tokenizer, prompts, how, progress)
        timings["generate_s"] = time.perf_counter() - t
        save_file({k: v.contiguous() for k, v in data.items()}, str(data_file))
        fp_file.write_text(json.dumps(_fingerprint(cfg)))
    draft = init_draft(target, cfg.layers).to(cfg.device)
    del target
    run = train(draft, data, cfg, work / "checkpoint.safetensors", progress)
    timings["train_s"] = run.train_s
    meta = DraftSummary(
        target=str(cfg.target),
        target_path=str(src.path),
        config={k: str(v) for k, v in asdict(cfg).items()},
        data=DraftData(
            samples=int(data["tokens"].shape[0]),
            generated_tokens=int(data["gen_len"].sum()),
            prompt_tokens=int(data["prompt_len"].sum()),
        ),
        loss="KL(renormalised target top-k || draft) at generated positions",
        init=f"target layers 0..{cfg.layers - 1} + final norm + tied embedding/LM head (frozen)",
        **run.fields(),
        timings=timings,
        losses=run.losses,
    )
    with atomic_output_dir(Path(cfg.output), cfg.overwrite) as tmp:
        draft.to(torch.bfloat16).save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        save_file({k: data[k].contiguous() for k in ("tokens", "prompt_len", "gen_len")}, str(tmp / DATA_FILE))
        meta.write(tmp / DRAFT_META)
    if not cfg.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return meta
