"""draft-train --kind eagle3: train an EAGLE-3 head for the (quantized) target it will serve.

1. Data (`eagle3_data`): the target's greedy generations from the training prompts (simulated engine
   numerics for an fp8ptq export; prompts sorted by length so a batch pads little; `sampled_data` adds
   T = 1 batches), plus `plain_texts` passages of text (built-in, then the stdlib's docstrings); cached.
2. Vocabulary (VocabTrim): the `draft_vocab` target ids most frequent in the target's generations
   (special tokens forced in); d2t / t2d as vLLM reads them. draft_vocab 0 = the full vocabulary.
3. Capture (streamed, `eagle3_data.capture`): one target forward per batch of similar-length sequences
   records the residual streams at the aux layer ids and the target's last residual stream over its RMS
   (`final`), with the target's LM head over the last position only; small safetensors shards.
4. Training-time test (`eagle3_loss`): the head runs `ttt_steps` times over each sequence; step k reads the
   ground-truth next token and ITS OWN pre-norm output of step k-1 one position earlier (what vLLM
   feeds it at draft step k+1), attending to the step-0 keys of its chain's prefix and to its chain's
   own keys of steps 1..k. Loss: Σ_k 0.8^k · KL(target ‖ head) over the kept ids, at the loss rows only
   (generated and plain-text rows, not prompts), the head's logits computed there only. The teacher is the
   target's own distribution over the kept ids, computed in the step from what the target's LM head read
   (`normed`) through its LM-head rows of the kept ids (the head's LM head holds those rows, frozen). Batches
   draw similar-length sequences across all shards each epoch; bf16 autocast where the CPU computes bf16
   natively (`precision`). Optional regularisers: noise on the aux states (`aux_noise`, relative to each
   layer's RMS) and the EAGLE-1 feature-regression term (`feature_loss`).
5. Resumable (checkpoint = trainable weights + AdamW moments + step; batch order a pure function of
   (seed, step)), progress, a time budget over the whole run (data, capture and training); output atomic:
   config.json + model.safetensors in vLLM 0.32's EAGLE-3 layout (see fp8ptq.spec.eagle3),
   fp8ptq_eagle3.json with each phase's tokens/s beside a plain prefill's.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch
from safetensors.torch import load_file, save_file

from fp8ptq.draft.config import Eagle3TrainConfig
from fp8ptq.draft.eagle3_data import (
    BatchPlan,
    ShardStore,
    capture,
    generated_sequences,
    has_current_layout,
    plain_sequences,
    prefill_floor,
)
from fp8ptq.draft.eagle3_loss import Objective, Teacher, loss_rows, ttt_loss
from fp8ptq.draft.eagle3_warm import linear_warm_start
from fp8ptq.draft.loop import TrainRun, TrainSummary, fit, load_checkpoint, locked_output, trainable
from fp8ptq.spec import SpecError
from fp8ptq.spec.eagle3 import EAGLE3_META, build_head, default_layer_ids, export_config, export_state, init_lm_head


@dataclass(frozen=True)
class Eagle3Data:
    generations: int  # target generations
    generated_tokens: int
    sequences: int  # generations + plain passages trained on
    tokens: int
    loss_rows: int  # positions the loss reads (generated and plain-text rows)


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
    precision: str  # what training ran in: bf16 (autocast) or fp32
    throughput: dict[str, float]  # tokens/s per phase of this run, and a plain prefill's (the floor)


def _fingerprint(cfg: Eagle3TrainConfig, layer_ids: list[int]) -> dict:
    keys = ("target", "prompts", "text_field", "num_prompts", "gen_tokens", "max_prompt_tokens", "plain_texts")
    keys += ("sampled_data", "loss_on_prompt", "seed", "capture_batch", "generator")  # not draft_vocab: every trim
    return {k: str(getattr(cfg, k)) for k in keys} | {"layer_ids": str(layer_ids), "plain_texts": str(plain_count(cfg))}


def _same_data(fp_file: Path, cfg: Eagle3TrainConfig, layer_ids: list[int]) -> bool:
    """The work dir's generations and hidden states were made with these settings (a fingerprint
    written before draft_vocab left it still counts)."""
    if not fp_file.is_file():
        return False
    stored = json.loads(fp_file.read_text())
    stored.pop("draft_vocab", None)
    stored.setdefault("generator", "hf")  # written before there was a choice
    return stored == _fingerprint(cfg, layer_ids)


def bf16_native() -> bool:
    """The CPU computes bf16 matrix products natively (AVX512-BF16 or AMX), where autocast pays."""
    cpu = getattr(torch, "cpu", None)
    return any(bool(getattr(cpu, f, lambda: False)()) for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def training_precision(precision: str, device: str) -> str:
    if precision not in ("auto", "bf16", "fp32"):
        raise SpecError(f"precision '{precision}' is not one of auto, bf16, fp32", fix="use --precision auto")
    if precision != "auto":
        return precision
    return "bf16" if device.startswith("cuda") or bf16_native() else "fp32"


def train_head(head, work: Path, n_shards: int, cfg: Eagle3TrainConfig, progress=None) -> tuple[TrainRun, dict, dict]:
    """The training loop (loop.fit) on the TTT loss; the warm start's numbers; the tokens, padded tokens and
    loss rows the steps read (this run's)."""
    head.lm_head.weight.requires_grad_(False)  # the target's rows: the teacher reads them too
    teacher = Teacher(head.lm_head.weight.detach().clone())
    params = trainable(head)
    opt = torch.optim.AdamW([p for _, p in params], lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = work / "checkpoint.safetensors"
    resumed = (0, [], 0.0)
    head_file = work / HEAD_FILE
    if cfg.resume and ckpt.is_file() and head_file.is_file():
        if json.loads(head_file.read_text()) == _head_key(head):  # else: another trim (or fc_norm), trained afresh
            resumed = load_checkpoint(ckpt, head, opt, cfg.device)
    head_file.write_text(json.dumps(_head_key(head)))
    warm = None
    if cfg.warm_start and resumed[0] == 0 and cfg.max_steps > 0:
        warm = linear_warm_start(head, work, n_shards, cfg.seed)
    store = ShardStore(work, n_shards)
    plan = BatchPlan(store.lengths(), cfg.batch_size, cfg.seed)
    bf16 = training_precision(cfg.precision, cfg.device) == "bf16"
    dev_type = "cuda" if cfg.device.startswith("cuda") else "cpu"

    read = {"tok": 0, "padded_tok": 0, "loss_rows": 0}
    objective = Objective.of(cfg)

    def loss_at(step: int) -> torch.Tensor:
        batch = store.batch(plan(step))
        read["tok"] += int(batch["lens"].sum())
        read["padded_tok"] += batch["ids"].numel()
        read["loss_rows"] += int(loss_rows(batch["lens"], batch["loss_from"], batch["ids"].shape[1]).sum())
        with torch.autocast(dev_type, dtype=torch.bfloat16, enabled=bf16):
            return ttt_loss(head, batch, objective, teacher, cfg.device, step)

    run = fit(head, opt, cfg, loss_at, ckpt=ckpt, resumed=resumed, progress=progress)
    return run, warm, read


HEAD_FILE = "head.json"  # the head a work dir's checkpoint belongs to


def _head_key(head) -> dict:
    return {"draft_vocab": head.s.draft_vocab, "fc_norm": head.s.fc_norm, "layer_ids": list(head.s.layer_ids)}


def _generate(target, tokenizer, path: Path, cfg: Eagle3TrainConfig, progress) -> tuple[dict, float | None]:
    """The target's generations from the training prompts, shortest prompts batched together (by
    transformers on the simulated target, or by vLLM from the checkpoint at `path`: `generator`), and vLLM's
    own generate time (None for transformers)."""
    from fp8ptq.draft.eagle3_data import engine_generations
    from fp8ptq.draft.train import Generation, generate_data
    from fp8ptq.spec.prompts import encode_prompts, load_prompts

    texts = load_prompts(cfg.prompts, "calibration", cfg.num_prompts, cfg.seed, cfg.text_field)
    prompts = sorted(encode_prompts(tokenizer, texts, max_tokens=cfg.max_prompt_tokens), key=len)
    if cfg.generator == "vllm":
        if progress:
            progress("generate (vLLM)", 0, 1)
        out = engine_generations(path, prompts, cfg.gen_tokens, seed=cfg.seed, sampled=cfg.sampled_data)
        if progress:
            progress("generate (vLLM)", 1, 1)
        return out
    # topk 0: the training step computes the target's distributions from the captured final feature
    how = Generation(
        cfg.gen_tokens, cfg.gen_batch_size, topk=0, seed=cfg.seed, device=cfg.device, sample_odd=cfg.sampled_data
    )
    return generate_data(target, tokenizer, prompts, how, progress), None


def _loss_name(cfg: Eagle3TrainConfig) -> str:
    term = "KL(target || head) over the kept ids"
    if cfg.feature_loss > 0:
        term = f"({term} + {cfg.feature_loss:g} SmoothL1(feature))"
    noise = f", aux noise σ {cfg.aux_noise:g}·rms" if cfg.aux_noise > 0 else ""
    return f"sum_k 0.8^k {term} at the loss rows, {cfg.ttt_steps} TTT steps{noise}"


def plain_count(cfg: Eagle3TrainConfig) -> int:
    if cfg.plain_texts is not None:
        return cfg.plain_texts
    return 200 if cfg.time_budget_s is None else int(cfg.time_budget_s / 4.5)


def _check(cfg: Eagle3TrainConfig) -> None:
    bad = cfg.ttt_steps < 1 or cfg.max_steps < 0 or cfg.batch_size < 1 or cfg.capture_batch < 1 or cfg.draft_vocab < 0
    if cfg.generator not in ("hf", "vllm"):
        raise SpecError(f"generator '{cfg.generator}' is not one of hf, vllm", fix="use --generator hf")
    if cfg.generator == "vllm":
        from fp8ptq.engine.vllm import vllm_python

        vllm_python()  # no vLLM venv: refused here, before any work
    for name in ("aux_noise", "feature_loss"):
        value = getattr(cfg, name)
        if not 0.0 <= value < 100.0:  # NaN too
            raise SpecError(
                f"bad eagle3 setting {name}={value}", fix=f"--{name.replace('_', '-')} is ≥ 0 (0 = off), e.g. 0.1"
            )
    if bad:
        raise SpecError(
            f"bad eagle3 settings: ttt_steps={cfg.ttt_steps}, max_steps={cfg.max_steps}, batch_size={cfg.batch_size}, "
            f"capture_batch={cfg.capture_batch}, draft_vocab={cfg.draft_vocab}",
            fix="ttt_steps, batch_size, capture_batch ≥ 1; max_steps, draft_vocab ≥ 0 (0 = the full vocabulary)",
        )


# in the work folder: the generations, and what they were generated for (a resumed run reuses both)
WORK_DATA, WORK_FINGERPRINT = "data.safetensors", "eagle3.json"


def _fresh_data(target, tokenizer, cfg: Eagle3TrainConfig, *, src_path: Path, work: Path, layer_ids, progress):
    """The target's generations, into an emptied work folder with the fingerprint that lets a resumed run
    reuse them; (generation seconds, tokens/s rates)."""
    for old in work.glob("*"):
        old.unlink() if old.is_file() else shutil.rmtree(old)
    t = time.perf_counter()
    data, engine_s = _generate(target, tokenizer, src_path, cfg, progress)
    generate_s = time.perf_counter() - t
    rates = {"generate_tok_s": float(data["gen_len"].sum()) / max(generate_s, 1e-9)}
    if engine_s is not None:  # vLLM's own generate time: its steady rate, start-up excluded
        rates["generate_engine_tok_s"] = float(data["gen_len"].sum()) / max(engine_s, 1e-9)
    save_file({k: data[k].contiguous() for k in ("tokens", "prompt_len", "gen_len")}, str(work / WORK_DATA))
    (work / WORK_FINGERPRINT).write_text(json.dumps(_fingerprint(cfg, layer_ids)))  # a capture cut short keeps these
    return generate_s, rates


def _write_head(cfg: Eagle3TrainConfig, src_path: Path, head, data: dict, meta: Eagle3Summary) -> None:
    """The head as vLLM and SGLang load it, its training data and its summary, into cfg.output atomically."""
    from fp8ptq.draft.train import DATA_FILE
    from fp8ptq.io import atomic_output_dir

    tcfg = json.loads((src_path / "config.json").read_text())
    with atomic_output_dir(Path(cfg.output), cfg.overwrite) as tmp:
        save_file(export_state(head), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(export_config(tcfg, head.s), indent=2) + "\n")
        save_file({k: data[k].contiguous() for k in ("tokens", "prompt_len", "gen_len")}, str(tmp / DATA_FILE))
        meta.write(tmp / EAGLE3_META)


@locked_output
def eagle3_train(cfg: Eagle3TrainConfig, progress=None) -> Eagle3Summary:
    """Generate, count, capture, train, export (atomically). A time budget covers the whole run: training
    gets what generation and capture left of it (at least one step)."""
    from fp8ptq.draft.train import work_dir
    from fp8ptq.draft.trim import choose_kept, count_tokens
    from fp8ptq.io import check_output
    from fp8ptq.spec.models import load_target

    t_run = time.perf_counter()
    check_output(Path(cfg.output), cfg.overwrite, (cfg.target, cfg.prompts))
    _check(cfg)
    precision = training_precision(cfg.precision, cfg.device)  # refused here, before any work, if unknown
    torch.manual_seed(cfg.seed)
    timings, rates = {}, {}
    target, src = load_target(cfg.target, cfg.device)
    tokenizer = src.tokenizer()
    L, V = int(target.model.config.num_hidden_layers), int(target.model.config.vocab_size)
    layer_ids = list(cfg.layer_ids) if cfg.layer_ids else default_layer_ids(L)
    keep = min(cfg.draft_vocab or V, V)  # a draft vocabulary as large as the target's is no trim
    head = build_head(target.model, layer_ids, keep, cfg.fc_norm)  # validates the layer ids before the expensive part
    layer_ids = head.s.layer_ids  # sorted, distinct: vLLM's order of the fc input
    work = work_dir(cfg.output)
    work.mkdir(parents=True, exist_ok=True)
    fresh = not _same_data(work / WORK_FINGERPRINT, cfg, layer_ids)
    if fresh:
        where = dict(src_path=Path(src.path), work=work, layer_ids=layer_ids, progress=progress)
        timings["generate_s"], generated = _fresh_data(target, tokenizer, cfg, **where)
        rates |= generated
    data = load_file(str(work / WORK_DATA))
    counts = count_tokens(data["tokens"], data["prompt_len"], data["gen_len"], V)
    kept = choose_kept(counts, keep, list(tokenizer.all_special_ids)) if keep < V else torch.arange(V)
    coverage = float(counts[kept].sum()) / max(1, int(counts.sum()))
    init_lm_head(head, target.model, kept.to(cfg.device) if keep < V else kept)
    plain = plain_sequences(tokenizer, plain_count(cfg), cfg.max_prompt_tokens + cfg.gen_tokens, cfg.seed)
    seqs = generated_sequences(data, cfg.loss_on_prompt) + plain
    n_shards = math.ceil(len(seqs) / cfg.capture_batch)
    if fresh or not has_current_layout(work / f"shard-{n_shards - 1:05d}.safetensors"):
        rates["prefill_floor_tok_s"] = prefill_floor(target, seqs, cfg.capture_batch, cfg.device)
        t = time.perf_counter()
        tokens = capture(target, seqs, layer_ids, work, batch=cfg.capture_batch, device=cfg.device, progress=progress)
        timings["capture_s"] = time.perf_counter() - t
        rates["capture_tok_s"] = tokens / max(timings["capture_s"], 1e-9)
    del target
    head = head.to(cfg.device)
    budget = cfg.time_budget_s
    if budget is not None:  # the whole run's budget: training gets the rest (fit runs one step at least)
        budget = max(budget - (time.perf_counter() - t_run), 1e-3)
    run, warm, trained = train_head(
        head, work, n_shards, replace(cfg, time_budget_s=budget, precision=precision), progress
    )
    timings["train_s"] = run.train_s
    rates |= {f"train_{k}_s": v / max(run.train_s, 1e-9) for k, v in trained.items()}
    n_rows = sum(max(0, len(q.ids) - 2 - q.loss_from) for q in seqs)
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
            tokens=sum(len(q.ids) for q in seqs),
            loss_rows=n_rows,
        ),
        loss=_loss_name(cfg),
        **run.fields(),
        warm_start=warm,
        precision=precision,
        throughput=rates,
        timings=timings,
        losses=run.losses,
    )
    _write_head(cfg, Path(src.path), head, data, meta)
    if not cfg.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return meta
