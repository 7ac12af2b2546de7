"""draft-trim (VocabTrim): keep the draft's LM-head rows of the N target tokens it most needs.

Frequencies are counted on TARGET-GENERATED text (the VocabTrim finding: better than raw corpus text):
the generations draft-train stored in the draft (fp8ptq_draft_data.st), or fresh generations
by the target when that file is absent. The top N ids are kept, plus every special token.

Outputs (in OUT):
- the trimmed draft: HF files with `lm_head.weight` [N, H] (untied), the full-vocabulary embedding
  (its inputs are still target tokens), config `draft_vocab_size: N`, and the EAGLE-3-style tensors
  `d2t` [N] int64 (draft id i -> target id i + d2t[i]) and `t2d` [V] bool (kept target ids) inside
  model.safetensors; fp8ptq_trim.json. fp8ptq's harness loads it (spec.models.load_draft); no engine
  runs this as a `draft_model` (vLLM needs the full vocabulary; see docs/speculative.md).
- token_map.pt: `torch.save` of the kept target ids (a list of ints), the file SGLang reads with
  --speculative-token-map (torch.load(weights_only=True)); SGLang is meant to apply it to the FULL draft,
  but 0.5.23's STANDALONE worker indexes it with full-vocabulary ids, so `spec recommend` does not pass it.
- kept_token_ids.json: the same ids as JSON, for anything else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp8ptq.draft.config import DraftTrimConfig
from fp8ptq.draft.train import DATA_FILE
from fp8ptq.results import to_json
from fp8ptq.spec import SpecError
from fp8ptq.spec.models import TRIM_META, TrimSummary

TOKEN_MAP = "token_map.pt"


def count_tokens(tokens: torch.Tensor, prompt_len: torch.Tensor, gen_len: torch.Tensor, vocab: int) -> torch.Tensor:
    """Frequency [V] of the generated tokens (prompt tokens excluded: the target did not write them)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for i in range(tokens.shape[0]):
        p, g = int(prompt_len[i]), int(gen_len[i])
        counts += torch.bincount(tokens[i, p : p + g].long(), minlength=vocab)[:vocab]
    return counts


def choose_kept(counts: torch.Tensor, keep: int, special_ids: list[int]) -> torch.Tensor:
    """The `keep` most frequent ids (ties: lower id first) with every special id forced in; sorted ascending."""
    vocab = counts.numel()
    special = sorted({i for i in special_ids if 0 <= i < vocab})
    if keep < len(special) or keep > vocab:
        raise SpecError(
            f"--keep {keep} must be between the {len(special)} special tokens and the vocabulary size {vocab}",
            fix=f"pass --keep in {len(special)}..{vocab}",
        )
    score = counts.double() - torch.arange(vocab, dtype=torch.float64) / (2 * vocab)  # stable tie-break by id
    score[special] = float("inf")
    return score.topk(keep).indices.sort().values


def d2t_offsets(kept: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 convention: target id = draft id + d2t[draft id]."""
    return kept - torch.arange(kept.numel(), dtype=kept.dtype)


def t2d_mask(kept: torch.Tensor, vocab: int) -> torch.Tensor:
    m = torch.zeros(vocab, dtype=torch.bool)
    m[kept] = True
    return m


def _split(data: dict, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = data["tokens"].shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    held = max(1, int(n * fraction)) if n > 1 and fraction > 0 else 0
    return perm[held:], perm[:held]


def draft_trim(cfg: DraftTrimConfig, progress=None) -> TrimSummary:
    """Count, choose, write OUT (atomically). Returns a summary (kept, coverage, LM-head saving)."""
    from fp8ptq.io import atomic_output_dir, check_output
    from fp8ptq.models.config_checks import check_same_vocabulary
    from fp8ptq.models.loader import resolve_model

    check_output(Path(cfg.output), cfg.overwrite, (cfg.draft, cfg.target))
    dsrc = resolve_model(str(cfg.draft))
    if (Path(cfg.draft) / TRIM_META).is_file():
        raise SpecError(f"'{cfg.draft}' is already trimmed", fix="trim the full draft written by draft-train")
    tsrc = resolve_model(str(cfg.target))
    vocab, tvocab = int(dsrc.config.vocab_size), int(tsrc.config.vocab_size)
    if vocab != tvocab:
        raise SpecError(
            f"draft vocabulary size {vocab} != target vocabulary size {tvocab}",
            fix="trim a draft trained for this target (fp8ptq draft-train)",
        )
    tokenizer = dsrc.tokenizer()
    # The same size is not the same vocabulary: a permuted tokenizer would keep the wrong rows.
    check_same_vocabulary(dsrc, tsrc, tsrc.tokenizer(), fix="trim a draft trained for this target (fp8ptq draft-train)")
    data_path = Path(cfg.draft) / DATA_FILE
    if data_path.is_file():
        data, source = load_file(str(data_path)), f"{DATA_FILE} (draft-train's target generations)"
    else:
        from fp8ptq.draft.train import Generation, generate_data
        from fp8ptq.spec.models import load_target
        from fp8ptq.spec.prompts import encode_prompts, load_prompts

        target, _ = load_target(cfg.target, cfg.device)
        prompts = encode_prompts(tokenizer, load_prompts(None, "calibration", cfg.num_prompts, cfg.seed))
        how = Generation(cfg.gen_tokens, batch_size=16, topk=1, seed=cfg.seed, device=cfg.device)
        data = generate_data(target, tokenizer, prompts, how, progress)
        source = f"{cfg.num_prompts} fresh target generations"
    fit, held = _split(data, cfg.heldout_fraction, cfg.seed)
    counts = count_tokens(data["tokens"][fit], data["prompt_len"][fit], data["gen_len"][fit], vocab)
    special = list(tokenizer.all_special_ids) + [int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})]
    kept = choose_kept(counts, cfg.keep, special)
    coverage_fit = float(counts[kept].sum()) / max(1, int(counts.sum()))
    coverage_held = None
    if held.numel():
        hc = count_tokens(data["tokens"][held], data["prompt_len"][held], data["gen_len"][held], vocab)
        coverage_held = float(hc[kept].sum()) / max(1, int(hc.sum()))
    state = {n: dsrc.tensor(n) for n in dsrc.weight_map}
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    hidden = head.shape[1]
    state["lm_head.weight"] = head[kept].contiguous().clone()
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"].contiguous().clone()
    state["d2t"] = d2t_offsets(kept).contiguous()
    state["t2d"] = t2d_mask(kept, vocab)
    config = json.loads((Path(cfg.draft) / "config.json").read_text())
    config.update(tie_word_embeddings=False, draft_vocab_size=cfg.keep)
    summary = TrimSummary(
        draft=str(cfg.draft),
        target=str(cfg.target),
        keep=cfg.keep,
        vocab=vocab,
        special_kept=len(set(special) & set(kept.tolist())),
        frequency_source=source,
        counted_tokens=int(counts.sum()),
        coverage_counted=coverage_fit,
        coverage_heldout=coverage_held,
        lm_head_rows=[vocab, cfg.keep],
        lm_head_flops_saving=1 - cfg.keep / vocab,
        lm_head_params=[vocab * hidden, cfg.keep * hidden],
    )
    with atomic_output_dir(Path(cfg.output), cfg.overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))
        torch.save(kept.tolist(), tmp / TOKEN_MAP)  # an OUTPUT for SGLang; fp8ptq never loads it
        (tmp / "kept_token_ids.json").write_text(json.dumps(kept.tolist()) + "\n")
        (tmp / TRIM_META).write_text(json.dumps(to_json(summary), indent=2) + "\n")
    return summary
