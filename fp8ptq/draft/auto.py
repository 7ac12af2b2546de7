"""`quantize --draft auto`: draft + (optional) trimmed draft + measured recommendation in one folder.

Contract (for fp8ptq.api.quantize, which owns the output directory):

    build_draft_bundle(target_dir, out_dir, *, layers=2, max_steps=None, time_budget_s=900.0,
                       trim_keep=None, gammas=(1..8), temperature=0.0, num_prompts=8, max_tokens=64,
                       device_memory=None, seed=0, device="cpu", progress=None, train=None,
                       kind="model") -> dict

- target_dir: the FINISHED quantized checkpoint (any compressed-tensors dir or plain HF dir); it is
  read, never written. The draft is distilled from it under simulated engine numerics.
- out_dir: usually the quantize output folder (the caller's temp dir while it is being written
  atomically). This function creates, and only creates:
      out_dir/draft/                      HF draft (full vocabulary: vLLM `draft_model`, SGLang STANDALONE),
                                          or with kind="eagle3" an EAGLE-3 head (vLLM `eagle3`, SGLang
                                          EAGLE3; trim_keep = its draft vocabulary, no draft-trimmed/)
      out_dir/draft-trimmed/              only if trim_keep: VocabTrim draft + token_map.pt + d2t/t2d
      out_dir/speculative_config.json     the vLLM --speculative-config dict; "model" is the RELATIVE
                                          path "draft" (resolve it against the folder when serving)
      out_dir/sglang_flags.txt            the equivalent SGLang server flags
      out_dir/speculative/                recommendation.json, measure.json, speculative.png
  It raises SpecError (an Fp8ptqError) on bad settings before any training, and leaves whatever it
  wrote for the caller's atomic dir to discard on failure.
- Returns a JSON-able summary for the manifest: {"draft": {...draft-train meta without losses},
  "trimmed": {...} | None, "recommendation": {gamma, tau, speedup, c, worth_it, table},
  "speculative_config": {...}, "sglang_flags": [...], "files": {...relative paths}, "timings": {...}}.
- train: extra DraftTrainConfig (kind="eagle3": Eagle3TrainConfig) fields (e.g. {"num_prompts": 64}).
- progress(stage, done, total) as everywhere else (stages: generate, train, measure, costs).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from fp8ptq.spec import SpecError
from fp8ptq.spec.recommend import sglang_flags, vllm_config


def build_draft_bundle(
    target_dir: Path,
    out_dir: Path,
    *,
    layers: int = 2,
    max_steps: int | None = None,  # None: the kind's trainer default (DraftTrainConfig / Eagle3TrainConfig)
    time_budget_s: float | None = 900.0,
    trim_keep: int | None = None,
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8),
    temperature: float = 0.0,
    num_prompts: int = 8,
    max_tokens: int = 64,
    device_memory: str | None = None,
    seed: int = 0,
    device: str = "cpu",
    progress=None,
    train: dict | None = None,
    kind: str = "model",
) -> dict:
    from fp8ptq.draft.train import DraftTrainConfig, draft_train
    from fp8ptq.draft.trim import TOKEN_MAP, DraftTrimConfig, draft_trim
    from fp8ptq.spec.run import MeasureConfig, RecommendConfig, check_gammas, recommend

    check_gammas(gammas)
    if kind not in ("model", "eagle3"):
        raise SpecError(f"unknown draft kind '{kind}'", fix="use model (a small draft LLM) or eagle3 (an EAGLE-3 head)")
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    draft_dir = out_dir / "draft"
    common = dict(target=str(target_dir), output=draft_dir, time_budget_s=time_budget_s)
    if max_steps is not None:
        common["max_steps"] = max_steps
    common |= dict(seed=seed, device=device, **(train or {}))
    if kind == "eagle3":
        from fp8ptq.draft.eagle3_train import Eagle3TrainConfig, eagle3_train

        vocab = {} if trim_keep is None else {"draft_vocab": trim_keep}
        meta = eagle3_train(Eagle3TrainConfig(**common, **vocab), progress)
    else:
        meta = draft_train(DraftTrainConfig(**common, layers=layers), progress)
    eagle3 = kind == "eagle3"
    timings = {"draft_train_s": time.perf_counter() - t0}
    trimmed = None
    if trim_keep and not eagle3:  # an EAGLE-3 head is trimmed as it is trained
        t = time.perf_counter()
        trimmed = draft_trim(
            DraftTrimConfig(
                draft=draft_dir,
                target=str(target_dir),
                keep=trim_keep,
                output=out_dir / "draft-trimmed",
                seed=seed,
                device=device,
            ),
            progress,
        )
        timings["draft_trim_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rec = recommend(
        RecommendConfig(
            output=out_dir / "speculative",
            temperature=temperature,
            draft_for_engine="draft",
            token_map=f"draft-trimmed/{TOKEN_MAP}" if trimmed else None,
            device_memory=device_memory,
            measure=MeasureConfig(
                target=str(target_dir),
                draft=str(draft_dir),
                gammas=tuple(gammas),
                temperatures=(float(temperature),),
                num_prompts=num_prompts,
                max_tokens=max_tokens,
                seed=seed,
                device=device,
            ),
        ),
        progress,
    )
    timings["measure_recommend_s"] = time.perf_counter() - t
    # The engine files sit at the top of the folder, beside the target they belong to.
    for name in ("speculative_config.json", "sglang_flags.txt"):
        shutil.copy2(out_dir / "speculative" / name, out_dir / name)
    return {
        "draft": {k: v for k, v in meta.items() if k != "losses"},
        "trimmed": trimmed,
        "recommendation": {
            "gamma": rec["gamma"],
            "tau": rec["tau"],
            "speedup": rec["speedup"],
            "c": rec["costs"]["c"],
            "costs_source": rec["costs"]["source"],
            "worth_it": rec["worth_it"],
            "table": rec["table"],
        },
        "kind": kind,
        "speculative_config": vllm_config("draft", rec["gamma"], eagle3=eagle3),
        "sglang_flags": sglang_flags(
            "draft", rec["gamma"], f"draft-trimmed/{TOKEN_MAP}" if trimmed else None, eagle3=eagle3
        ),
        "files": {
            "draft": "draft",
            "trimmed": "draft-trimmed" if trimmed else None,
            "vllm": "speculative_config.json",
            "sglang": "sglang_flags.txt",
            "recommendation": "speculative/recommendation.json",
            "plot": "speculative/speculative.png",
        },
        "timings": {**timings, "total_s": time.perf_counter() - t0},
    }
