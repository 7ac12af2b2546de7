"""draft-train --kind eagle3's data: the sequences trained on, the capture pass that records what the head
reads, and the batches a training step draws.

- Sequences: the target's greedy generations (prompt + generation; the loss starts at the last prompt
  token, so prompt and chat-template rows carry none) and passages of plain text cut to a fixed length —
  the built-in calibration texts, then the standard library's docstrings — (every row carries the loss:
  the target's distribution over text it did not write is a teacher signal at prefill speed).
- Capture: one target forward per batch of sequences of similar length (sorted, so little padding), with
  the LM head over the last position only (`logits_to_keep=1`): the head's inputs (the residual streams at
  the aux layer ids), the target's last residual stream over its RMS (`final`, fp16: the linear warm
  start's target) and what the target's LM head reads there (`normed`, its final norm's output, fp16).
  The teacher's distribution is not stored: the training step computes it from `normed` through the
  target's LM-head rows of the kept ids, what the target computes there, over every kept id.
- Batches: per epoch a seeded permutation of all sequences, cut into groups of 16 batches, each group
  sorted by length (little padding), the batches then shuffled — a pure function of (seed, step), so a
  resumed run draws what an uninterrupted one would, and each epoch mixes sequences across shards.
"""

from __future__ import annotations

import inspect
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp8ptq.spec.eagle3_loop import AuxCapture, decoder_layers
from fp8ptq.spec.mtp import FinalHidden

SHARD_KEYS = ("aux", "final", "normed", "ids", "lens", "loss_from")  # a shard of the current layout holds these


@dataclass(frozen=True)
class Sequence:
    ids: list[int]
    loss_from: int  # first index i whose prediction (the target's distribution at i + 1) is trained on


STDLIB_SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "pydoc_data", "lib2to3", "ensurepip"}
STDLIB_SKIP |= {"site-packages", "dist-packages", "__pycache__"}  # pydoc_data: the measurement prompts' topics


def stdlib_docstrings(min_chars: int = 200) -> list[str]:
    """The docstrings of Python's own standard library (modules, classes, functions), one text per source
    file, read with `ast` from the files (nothing imported or run); pydoc's topics, which the held-out
    measurement prompts come from, are left out."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        if STDLIB_SKIP & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docs = [ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, kinds)]
        docs = [d for d in docs if d and len(d) >= min_chars]
        if docs:
            out.append("\n\n".join(docs))
    return out


def plain_sequences(tokenizer, n: int, length: int, seed: int) -> list[Sequence]:
    """Up to `n` passages of `length` tokens (the last of a text may be shorter) cut from the built-in
    calibration texts, then, when those run out, from the standard library's docstrings (stdlib_docstrings),
    each source in a seeded order."""
    from fp8ptq.data import BUILTIN, load_texts

    if n <= 0:
        return []
    out = []
    for source in (lambda: [t for t in load_texts(BUILTIN, "calibration") if len(t) > 200], stdlib_docstrings):
        texts = source()
        random.Random(seed).shuffle(texts)
        for t in texts:
            ids = tokenizer(t, add_special_tokens=False)["input_ids"]
            out += [Sequence(ids[i : i + length], 0) for i in range(0, len(ids), length) if len(ids) - i > 8]
            if len(out) >= n:
                return out[:n]
    return out


def engine_generations(
    model: Path, prompts: list[list[int]], gen_tokens: int, *, seed: int, sampled: bool
) -> tuple[dict, float]:
    """The target's generations by vLLM in its own venv (fp8ptq.engine.vllm): the engine's kernels and
    numerics, continuous batching, no padding. Greedy; `sampled`: every other prompt at T = 1 (a second job
    in the same process). Returns generate_data's tokens / prompt_len / gen_len (EOS kept as the last
    generated token) and the engine's own generate time in seconds (load excluded)."""
    from fp8ptq.engine.vllm import engine_dtype, run_vllm_jobs, vllm_request
    from fp8ptq.spec import SpecError

    if not (model / "config.json").is_file():
        raise SpecError(
            f"vLLM generates from a checkpoint directory; '{model}' has no config.json",
            fix="convert the target to a directory first (fp8ptq convert), or use --generator hf",
        )
    n, L = len(prompts), max(len(p) for p in prompts) + gen_tokens
    groups = [list(range(0, n, 2)), list(range(1, n, 2))] if sampled else [list(range(n))]
    jobs = [
        vllm_request(
            model,
            [prompts[i] for i in g],
            gen_tokens,
            temperature=float(t),
            seed=seed,
            dtype=engine_dtype(model),
            max_model_len=L,
            ignore_eos=False,
        )
        for t, g in enumerate(groups)
    ]
    runs = run_vllm_jobs(jobs, timeout_s=7200)
    outs: dict[int, list[int]] = {}
    for g, run in zip(groups, runs):
        if not run.ok:
            raise SpecError(
                f"vLLM could not generate the training data from '{model}': {run.error} (stage {run.stage})",
                fix="use --generator hf (transformers, fp8ptq's simulation of the engine's numerics)",
            )
        outs.update(zip(g, run.token_ids))
    tokens = torch.zeros(n, L, dtype=torch.long)
    plen, glen = torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(prompts):
        row = (p + outs[i])[:L]
        tokens[i, : len(row)] = torch.tensor(row)
        plen[i], glen[i] = len(p), len(row) - len(p)
    return {"tokens": tokens, "prompt_len": plen, "gen_len": glen}, sum(float(r.generate_s or 0.0) for r in runs)


def generated_sequences(data: dict, loss_on_prompt: bool = False) -> list[Sequence]:
    """The generations (prompt + generated tokens); the loss from the last prompt token on (the row that
    predicts the first generated token's successor) unless `loss_on_prompt`."""
    out = []
    for i in range(data["tokens"].shape[0]):
        p, n = int(data["prompt_len"][i]), int(data["prompt_len"][i] + data["gen_len"][i])
        out.append(Sequence(data["tokens"][i, :n].tolist(), 0 if loss_on_prompt else max(0, p - 2)))
    return out


def final_feature(last: torch.Tensor) -> torch.Tensor:
    """The target's last residual stream over its RMS (before the final norm's weight), fp16."""
    return (last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + 1e-6)).half()


def lm_head_input(model) -> tuple[FinalHidden, bool]:
    """A recorder of what the target's LM head reads: its final norm's output (the norm the family adapter
    or the generic path names), or, for a model fp8ptq cannot read that way, the LM head's own input — then
    True: the forward must run the head over every position for the hook to see them all."""
    from fp8ptq.errors import Fp8ptqError
    from fp8ptq.models.arch import arch_for

    try:
        return FinalHidden(model, arch_for(model.config).final_norm), False
    except (Fp8ptqError, AttributeError):
        head = model.get_output_embeddings()
        return FinalHidden(model, next(n for n, m in model.named_modules() if m is head), reads_input=True), True


def padded(chunk: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and attention mask [b, T] of the sequences, right-padded to the longest."""
    T = max(len(c.ids) for c in chunk)
    ids = torch.zeros(len(chunk), T, dtype=torch.long)
    mask = torch.zeros(len(chunk), T, dtype=torch.long)
    for r, c in enumerate(chunk):
        ids[r, : len(c.ids)], mask[r, : len(c.ids)] = torch.tensor(c.ids), 1
    return ids, mask


@torch.inference_mode()
def capture(target, seqs: list[Sequence], layer_ids, work: Path, *, batch: int, device: str, progress=None) -> int:
    """Shard files work/shard-XXXXX.safetensors of `batch` sequences each, longest first: aux [b, T, n·H]
    bf16, final and normed [b, T, H] fp16, ids [b, T], lens [b], loss_from [b]. Returns the tokens."""
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i].ids))
    n_shards = math.ceil(len(seqs) / batch)
    L = len(decoder_layers(target.model))
    ids_all = list(layer_ids) + ([] if L in layer_ids else [L])  # id L: after the last layer, before the norm
    tokens = 0
    recorder, full_logits = lm_head_input(target.model)
    with AuxCapture(target.model, ids_all) as cap, recorder as lm:
        for s in range(n_shards):
            chunk = [seqs[i] for i in order[s * batch : (s + 1) * batch]]
            ids, mask = padded(chunk)
            prefill(target.model, ids.to(device), mask.to(device), last_only=not full_logits)
            by_id = dict(zip(ids_all, cap.take().chunk(len(ids_all), -1)))
            shard = {
                "aux": torch.cat([by_id[i] for i in layer_ids], -1).to(torch.bfloat16).cpu().contiguous(),
                "final": final_feature(by_id[L]).cpu().contiguous(),
                "normed": lm.take().half().cpu().contiguous(),
                "ids": ids,
                "lens": mask.sum(1),
                "loss_from": torch.tensor([c.loss_from for c in chunk], dtype=torch.long),
            }
            save_file(shard, str(work / f"shard-{s:05d}.safetensors"))
            tokens += int(mask.sum())
            if progress:
                progress("capture", s + 1, n_shards)
    return tokens


def prefill(model, ids: torch.Tensor, mask: torch.Tensor, last_only: bool = True):
    """One forward of the target, with its LM head over the last position only where `last_only` (what the
    head trains on comes from hooks; transformers' `logits_to_keep`, where the model's forward takes it)."""
    if last_only and "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(input_ids=ids, attention_mask=mask, logits_to_keep=1)
    return model(input_ids=ids, attention_mask=mask)


@torch.inference_mode()
def prefill_floor(target, seqs: list[Sequence], batch: int, device: str) -> float:
    """Tokens/s of a plain prefill (LM head over the last position, no hooks, nothing stored) over the
    longest `batch` sequences, the faster of two (the first pays the warm-up): what the capture's rate is
    compared with."""
    ids, mask = padded(sorted(seqs, key=lambda c: -len(c.ids))[:batch])
    best = math.inf
    for _ in range(2):
        t = time.perf_counter()
        prefill(target.model, ids.to(device), mask.to(device))
        best = min(best, time.perf_counter() - t)
    return float(mask.sum()) / max(best, 1e-9)


def has_current_layout(shard: Path) -> bool:
    """The shard exists and holds what this version's training reads (older captures stored the teacher's
    top-k and no loss start: captured again)."""
    if not shard.is_file():
        return False
    with safe_open(str(shard), "pt") as f:
        return set(SHARD_KEYS) <= set(f.keys())


class ShardStore:
    """The captured sequences, read a row at a time (safetensors slices of memory-mapped files)."""

    def __init__(self, work: Path, n_shards: int):
        self.files = [safe_open(str(work / f"shard-{s:05d}.safetensors"), "pt") for s in range(n_shards)]
        self.rows, self.loss_from = [], []  # (shard, row, length) and the loss start, per sequence
        for s, f in enumerate(self.files):
            for r, (n, lf) in enumerate(zip(f.get_tensor("lens").tolist(), f.get_tensor("loss_from").tolist())):
                self.rows.append((s, r, int(n)))
                self.loss_from.append(int(lf))

    def lengths(self) -> list[int]:
        return [n for _, _, n in self.rows]

    def batch(self, seq_ids: list[int]) -> dict[str, torch.Tensor]:
        """aux, normed, ids right-padded to the longest of the sequences, lens, loss_from."""
        T = max(self.rows[i][2] for i in seq_ids)
        parts = {"aux": [], "normed": [], "ids": []}
        for i in seq_ids:
            s, r, n = self.rows[i]
            for k in parts:
                x = self.files[s].get_slice(k)[r : r + 1, :n]
                parts[k].append(torch.nn.functional.pad(x, (0, 0, 0, T - n) if x.dim() == 3 else (0, T - n)))
        out = {k: torch.cat(v) for k, v in parts.items()}
        out["lens"] = torch.tensor([self.rows[i][2] for i in seq_ids])
        out["loss_from"] = torch.tensor([self.loss_from[i] for i in seq_ids])
        return out


def epoch_batches(lengths: list[int], batch: int, seed: int, epoch: int) -> list[list[int]]:
    """The batches of one epoch (module docstring): every sequence once, similar lengths together."""
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    group = 16 * batch
    out = []
    for j in range(0, len(perm), group):
        chunk = sorted(perm[j : j + group], key=lambda i: -lengths[i])
        out += [chunk[k : k + batch] for k in range(0, len(chunk), batch)]
    order = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in order]


class BatchPlan:
    """step -> the sequence ids of its batch (epoch_batches, one epoch cached)."""

    def __init__(self, lengths: list[int], batch: int, seed: int):
        self.lengths, self.batch, self.seed = lengths, batch, seed
        self.per_epoch = math.ceil(len(lengths) / batch)
        self.cached: tuple[int, list[list[int]]] | None = None

    def __call__(self, step: int) -> list[int]:
        epoch, off = divmod(step, self.per_epoch)
        if self.cached is None or self.cached[0] != epoch:
            self.cached = (epoch, epoch_batches(self.lengths, self.batch, self.seed, epoch))
        return self.cached[1][off]
