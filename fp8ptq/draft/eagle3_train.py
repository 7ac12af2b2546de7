"""draft-train --kind eagle3: train an EAGLE-3 head for the (quantized) target it will serve.

1. Data: the target (simulated engine numerics for an fp8ptq export) generates from the training prompts
   (`train.generate_data`: half greedy, half T = 1), plus `plain_texts` passages of plain built-in
   text. Cached in the work dir.
2. Vocabulary (VocabTrim): the `draft_vocab` target ids most frequent in the target's generations
   (special tokens forced in); d2t / t2d as vLLM reads them. draft_vocab 0 = the full vocabulary.
3. Capture (streamed): one target forward per batch of sequences records the residual streams at the
   aux layer ids and the target's top-k next-token log-probs at every position, written as small
   safetensors shards in the work dir; training reads one shard per step, so memory does not grow with
   the data.
4. Training-time test: the head runs `ttt_steps` times over each sequence; step k reads the
   ground-truth next token and ITS OWN pre-norm output of step k-1 one position earlier (what vLLM
   feeds it at draft step k+1), attending to the step-0 keys of its chain's prefix and to its chain's
   own keys of steps 1..k. Loss: Σ_k 0.8^k · KL(target top-k, renormalised over the kept ids ‖ head).
5. Resumable (checkpoint = trainable weights + AdamW moments + step; batch order a pure function of
   (seed, step)), progress, a time budget; output atomic: config.json + model.safetensors in vLLM 0.32's
   EAGLE-3 layout (see fp8ptq.spec.eagle3), fp8ptq_eagle3.json.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8ptq.draft.eagle3_warm import linear_warm_start
from fp8ptq.draft.loop import TrainRun, TrainSummary, fit, load_checkpoint, locked_output, trainable
from fp8ptq.spec import SpecError
from fp8ptq.spec.eagle3 import EAGLE3_META, build_head, default_layer_ids, export_config, export_state, init_lm_head
from fp8ptq.spec.eagle3_loop import AuxCapture, decoder_layers


@dataclass(frozen=True)
class Eagle3TrainConfig:
    target: str
    output: Path
    layer_ids: tuple[int, ...] | None = None  # None: [2, L // 2, L - 3]
    draft_vocab: int = 16384  # 0: the full target vocabulary
    prompts: str | None = None
    text_field: str = "text"
    num_prompts: int = 192
    gen_tokens: int = 128
    gen_batch_size: int = 16
    max_prompt_tokens: int = 256
    plain_texts: int = 32  # plain built-in text passages added to the generations
    topk: int = 32
    ttt_steps: int = 3
    fc_norm: bool = True  # an RMSNorm per aux layer before fc (vLLM's fc_norm)
    warm_start: bool = True  # start from a closed-form linear predictor (fp8ptq.draft.eagle3_warm)
    batch_size: int = 4  # sequences per step (= per shard)
    lr: float = 1e-3
    warmup_steps: int = 20
    max_steps: int = 2000
    time_budget_s: float | None = 900.0
    checkpoint_every: int = 50
    resume: bool = False
    seed: int = 0
    overwrite: bool = False
    keep_work: bool = False
    device: str = "cpu"


@dataclass(frozen=True)
class Eagle3Data:
    generations: int  # target generations
    generated_tokens: int
    sequences: int  # generations + plain passages trained on
    tokens: int


@dataclass(frozen=True, kw_only=True)
class Eagle3Summary(TrainSummary):
    """draft-train --kind eagle3's result; fp8ptq_eagle3.json in the head's folder (without `losses`)."""

    SCHEMA: ClassVar[str] = "eagle3-train"
    layer_ids: list[int]  # the target's aux layers, vLLM's fc input order
    draft_vocab: int
    vocab: int
    kept_coverage_of_generated_tokens: float
    data: Eagle3Data
    warm_start: dict | None  # the closed-form start (eagle3_warm.linear_warm_start), None when off


def _fingerprint(cfg: Eagle3TrainConfig, layer_ids: list[int]) -> dict:
    keys = ("target", "prompts", "text_field", "num_prompts", "gen_tokens", "max_prompt_tokens", "plain_texts")
    keys += ("topk", "seed", "batch_size")  # not draft_vocab: the data is the same for every trim
    return {k: str(getattr(cfg, k)) for k in keys} | {"layer_ids": str(layer_ids)}


def _same_data(fp_file: Path, cfg: Eagle3TrainConfig, layer_ids: list[int]) -> bool:
    """The work dir's generations and hidden states were made with these settings (a fingerprint
    written before draft_vocab left it still counts)."""
    if not fp_file.is_file():
        return False
    stored = json.loads(fp_file.read_text())
    stored.pop("draft_vocab", None)
    return stored == _fingerprint(cfg, layer_ids)


def _has_final(shard: Path) -> bool:
    """The shard exists and holds the target's final feature (captures before the warm start lack it)."""
    if not shard.is_file():
        return False
    with safe_open(str(shard), "pt") as f:
        return "final" in f.keys()


def plain_sequences(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    from fp8ptq.data import BUILTIN, load_texts

    if n <= 0:
        return []
    import random

    texts = [t for t in load_texts(BUILTIN, "calibration") if len(t) > 200]
    random.Random(seed).shuffle(texts)
    out = []
    for t in texts[:n]:
        ids = tokenizer(t, add_special_tokens=False)["input_ids"][:length]
        if len(ids) > 8:
            out.append(ids)
    return out


def sequences(data: dict, plain: list[list[int]]) -> list[list[int]]:
    """Generated samples (prompt + generation) then the plain passages."""
    out = []
    for i in range(data["tokens"].shape[0]):
        n = int(data["prompt_len"][i] + data["gen_len"][i])
        out.append(data["tokens"][i, :n].tolist())
    return out + plain


@torch.inference_mode()
def capture(target, seqs: list[list[int]], layer_ids, work: Path, *, batch: int, topk: int, device: str, progress=None):
    """Shard files work/shard-XXXXX.safetensors: aux [b, T, n·H] bf16, ids [b, T] int64, lens [b], top-k
    next-token ids [b, T, k] int32 and log-probs fp16 of the target at every position, and `final` [b, T, H]
    bf16: the target's last residual stream divided by its RMS (what its final norm scales for the LM head;
    the linear warm start's regression target). Returns the count."""
    n_shards = math.ceil(len(seqs) / batch)
    L = len(decoder_layers(target.model))
    # id L = after the last layer (AuxCapture), before the final norm; hooked once if the head reads it too
    ids_all = list(layer_ids) + ([] if L in layer_ids else [L])
    with AuxCapture(target.model, ids_all) as cap:
        for s in range(n_shards):
            chunk = seqs[s * batch : (s + 1) * batch]
            T = max(len(c) for c in chunk)
            ids = torch.zeros(len(chunk), T, dtype=torch.long)
            mask = torch.zeros(len(chunk), T, dtype=torch.long)
            for r, c in enumerate(chunk):
                ids[r, : len(c)], mask[r, : len(c)] = torch.tensor(c), 1
            logits = target.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            top = torch.log_softmax(logits, -1).topk(topk, -1)
            by_id = dict(zip(ids_all, cap.take().chunk(len(ids_all), -1)))
            last = by_id[L]
            shard = {
                "aux": torch.cat([by_id[i] for i in layer_ids], -1).to(torch.bfloat16).cpu().contiguous(),
                "final": (last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16).cpu(),
                "ids": ids,
                "lens": mask.sum(1),
                "top_ids": top.indices.int().cpu().contiguous(),
                "top_logp": top.values.half().cpu().contiguous(),
            }
            save_file(shard, str(work / f"shard-{s:05d}.safetensors"))
            if progress:
                progress("capture", s + 1, n_shards)
    return n_shards


def ttt_mask(T: int, k: int, device) -> torch.Tensor:
    """[T, (k+1)·T] bool: query i of step k sees step-0 keys j ≤ i - k and step-s keys j = i - k + s."""
    i = torch.arange(T, device=device).view(-1, 1)
    j = torch.arange(T, device=device).view(1, -1)
    blocks = [j <= i - k] + [j == i - k + s for s in range(1, k + 1)]
    return torch.cat(blocks, 1)


def ttt_loss(head, shard: dict, rows: list[int], steps: int, t2d_rows: torch.Tensor, device: str) -> torch.Tensor:
    """Σ_k 0.8^k · mean KL over the valid positions of step k (see the module docstring)."""
    lens = shard["lens"][rows]
    T = int(lens.max())
    ids = shard["ids"][rows, :T].to(device)
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)  # token i + 1 at index i
    pos = torch.arange(T, device=device)
    hid = head.fuse(shard["aux"][rows, :T].to(device).float())
    tgt_rows = t2d_rows[shard["top_ids"][rows, :T].long().to(device)]  # [B, T, k] draft rows (-1 = not kept)
    logp = shard["top_logp"][rows, :T].float().to(device).masked_fill(tgt_rows < 0, -torch.inf)
    logp = logp - torch.logsumexp(logp, -1, keepdim=True)
    p = logp.exp().nan_to_num(0.0)
    idx = torch.arange(T, device=device)
    keys, vals, total, wsum = [], [], 0.0, 0.0
    for k in range(steps):
        past = None if k == 0 else (torch.cat(keys, 2), torch.cat(vals, 2))
        out, logits, (kk, vv) = head.block(nxt, hid, pos, past, ttt_mask(T, k, device))
        keys.append(kk)
        vals.append(vv)
        # index i predicts token i + 2: the target's distribution at position i + 1 (valid: k ≤ i ≤ len - 3)
        valid = (idx >= k).view(1, -1) & (idx.view(1, -1) <= (lens.to(device) - 3).view(-1, 1))
        if valid.any():
            q = F.log_softmax(logits[:, :-1].float(), -1)  # index i vs target row i + 1
            tp, tr = p[:, 1:], tgt_rows[:, 1:].clamp(min=0)
            kl = (tp * (logp[:, 1:].nan_to_num(0.0, neginf=0.0) - q.gather(-1, tr))).sum(-1)  # [B, T-1]
            v = valid[:, :-1] & (tp.sum(-1) > 0)
            total = total + 0.8**k * kl[v].mean()
            wsum += 0.8**k
        hid = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)  # step k+1 at i reads out_k[i - 1]
    return total / max(wsum, 1e-9)


def step_rows(step: int, n_shards: int, seed: int) -> int:
    """The shard of training step `step` (a pure function: seeded per-epoch permutations of the shards)."""
    epoch, off = divmod(step, n_shards)
    return int(torch.randperm(n_shards, generator=torch.Generator().manual_seed(seed * 7919 + epoch))[off])


def train_head(head, work: Path, n_shards: int, cfg: Eagle3TrainConfig, progress=None) -> tuple[TrainRun, dict | None]:
    """The training loop (loop.fit) on the TTT loss, one capture shard per step; and the warm start's numbers."""
    params = trainable(head)
    opt = torch.optim.AdamW([p for _, p in params], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = work / "checkpoint.safetensors"
    resumed = (0, [], 0.0)
    if cfg.resume and ckpt.is_file():
        with safe_open(str(ckpt), "pt") as f:
            saved = f.get_slice("model.lm_head.weight").get_shape()[0]
            same = saved == head.s.draft_vocab and all(f"model.{n}" in f.keys() for n, _ in params)
        if same:  # else: a head of another trim (or without fc_norm) on the same data, trained afresh
            resumed = load_checkpoint(ckpt, head, opt, cfg.device)
    warm = None
    if cfg.warm_start and resumed[0] == 0 and cfg.max_steps > 0:
        warm = linear_warm_start(head, work, n_shards, cfg.seed)
    t2d_rows = head.target_to_draft()

    def loss_at(step: int) -> torch.Tensor:
        shard = load_file(str(work / f"shard-{step_rows(step, n_shards, cfg.seed):05d}.safetensors"))
        return ttt_loss(head, shard, list(range(shard["ids"].shape[0])), cfg.ttt_steps, t2d_rows, cfg.device)

    return fit(head, opt, cfg, loss_at, ckpt=ckpt, resumed=resumed, progress=progress), warm


@locked_output
def eagle3_train(cfg: Eagle3TrainConfig, progress=None) -> Eagle3Summary:
    """Generate, count, capture, train, export (atomically)."""
    from fp8ptq.draft.train import DATA_FILE, Generation, generate_data, work_dir
    from fp8ptq.draft.trim import choose_kept, count_tokens
    from fp8ptq.io import atomic_output_dir, check_output
    from fp8ptq.spec.models import load_target
    from fp8ptq.spec.prompts import encode_prompts, load_prompts

    check_output(Path(cfg.output), cfg.overwrite, (cfg.target, cfg.prompts))
    if cfg.ttt_steps < 1 or cfg.max_steps < 0 or cfg.topk < 1 or cfg.batch_size < 1 or cfg.draft_vocab < 0:
        raise SpecError(
            f"bad eagle3 settings: ttt_steps={cfg.ttt_steps}, max_steps={cfg.max_steps}, topk={cfg.topk}, "
            f"batch_size={cfg.batch_size}, draft_vocab={cfg.draft_vocab}",
            fix="ttt_steps, topk, batch_size ≥ 1; max_steps, draft_vocab ≥ 0 (draft_vocab 0 = full vocabulary)",
        )
    torch.manual_seed(cfg.seed)
    timings = {}
    target, src = load_target(cfg.target, cfg.device)
    tokenizer = src.tokenizer()
    tconf = target.model.config
    L, V = int(tconf.num_hidden_layers), int(tconf.vocab_size)
    layer_ids = list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(L)
    keep = min(cfg.draft_vocab or V, V)  # a draft vocabulary as large as the target's is no trim
    head = build_head(target.model, layer_ids, keep, cfg.fc_norm)  # validates the layer ids before the expensive part
    layer_ids = head.s.layer_ids  # sorted, distinct: vLLM's order of the fc input
    work = work_dir(cfg.output)
    work.mkdir(parents=True, exist_ok=True)
    fp_file, data_file = work / "eagle3.json", work / "data.safetensors"
    fresh = not _same_data(fp_file, cfg, layer_ids)
    if fresh:
        for old in work.glob("*"):
            old.unlink() if old.is_file() else shutil.rmtree(old)
        texts = load_prompts(cfg.prompts, "calibration", cfg.num_prompts, cfg.seed, cfg.text_field)
        t = time.perf_counter()
        prompts = encode_prompts(tokenizer, texts, max_tokens=cfg.max_prompt_tokens)
        # topk 0: the capture pass records the target's distributions
        how = Generation(cfg.gen_tokens, cfg.gen_batch_size, topk=0, seed=cfg.seed, device=cfg.device)
        data = generate_data(target, tokenizer, prompts, how, progress)
        timings["generate_s"] = time.perf_counter() - t
        save_file({k: data[k].contiguous() for k in ("tokens", "prompt_len", "gen_len")}, str(data_file))
    data = load_file(str(data_file))
    counts = count_tokens(data["tokens"], data["prompt_len"], data["gen_len"], V)
    special = list(tokenizer.all_special_ids)
    kept = choose_kept(counts, keep, special) if keep < V else torch.arange(V)
    coverage = float(counts[kept].sum()) / max(1, int(counts.sum()))
    init_lm_head(head, target.model, kept.to(cfg.device) if keep < V else kept)
    seqs = sequences(
        data, plain_sequences(tokenizer, cfg.plain_texts, cfg.max_prompt_tokens + cfg.gen_tokens, cfg.seed)
    )
    n_shards = math.ceil(len(seqs) / cfg.batch_size)
    if fresh or not _has_final(work / f"shard-{n_shards - 1:05d}.safetensors"):
        t = time.perf_counter()
        capture(
            target, seqs, layer_ids, work, batch=cfg.batch_size, topk=cfg.topk, device=cfg.device, progress=progress
        )
        timings["capture_s"] = time.perf_counter() - t
        fp_file.write_text(json.dumps(_fingerprint(cfg, layer_ids)))
    del target
    head = head.to(cfg.device)
    run, warm = train_head(head, work, n_shards, cfg, progress)
    timings["train_s"] = run.train_s
    meta = Eagle3Summary(
        target=str(cfg.target),
        target_path=str(src.path),
        config={k: str(v) for k, v in asdict(cfg).items()},
        layer_ids=layer_ids,
        draft_vocab=keep,
        vocab=V,
        kept_coverage_of_generated_tokens=coverage,
        data=Eagle3Data(
            generations=int(data["tokens"].shape[0]),
            generated_tokens=int(data["gen_len"].sum()),
            sequences=len(seqs),
            tokens=sum(len(s) for s in seqs),
        ),
        loss=f"sum_k 0.8^k KL(target top-{cfg.topk} renormalised over the kept ids || head), {cfg.ttt_steps} TTT steps",
        **run.fields(),
        warm_start=warm,
        timings=timings,
        losses=run.losses,
    )
    tcfg = json.loads((Path(src.path) / "config.json").read_text())
    with atomic_output_dir(Path(cfg.output), cfg.overwrite) as tmp:
        save_file(export_state(head), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(export_config(tcfg, head.s), indent=2) + "\n")
        save_file({k: data[k].contiguous() for k in ("tokens", "prompt_len", "gen_len")}, str(tmp / DATA_FILE))
        meta.write(tmp / EAGLE3_META)
    if not cfg.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return meta
