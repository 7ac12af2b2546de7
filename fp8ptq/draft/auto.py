"""`quantize --draft auto`: draft + (optional) trimmed draft + measured recommendation in one folder.

Contract (for fp8ptq.api.quantize, which owns the output directory):

    build_draft_bundle(target_dir, out_dir, cfg: DraftBundleConfig, *, device="cpu", progress=None) -> Speculative

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
- Returns the manifest's typed `speculative` part (fp8ptq.manifest.Speculative): the trainer's and
  trimmer's summaries as their files hold them, the recommended γ in short, the vLLM config, the
  SGLang flags, the files (relative paths) and the timings.
- cfg: the draft settings as one object (DraftBundleConfig); cfg.train: extra DraftTrainConfig
  (kind="eagle3": Eagle3TrainConfig) fields (e.g. {"num_prompts": 64}).
- progress(stage, done, total) as everywhere else (stages: generate, train, measure, costs).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fp8ptq.fields import documented
from fp8ptq.results import to_json
from fp8ptq.spec import SpecError
from fp8ptq.spec.recommend import sglang_flags, vllm_config

KINDS = ("model", "eagle3")  # DraftBundleConfig.kind
if TYPE_CHECKING:  # the manifest pulls in torch: runs/config.py (fp8ptq.api) imports this module
    from fp8ptq.manifest import Speculative

DRAFT_TIME_BUDGET_S = 900.0  # `quantize --draft`'s training budget (QuantizeConfig and the CLI read it here)


@dataclass(frozen=True)
class DraftBundleConfig:
    """The draft settings of `quantize --draft`, one object (runs/finish.py builds it from the command)."""

    kind: str = "model"  # model (a small draft LLM) | eagle3 (an EAGLE-3 head)
    layers: int = 2  # kind model: the draft's decoder layers
    max_steps: int | None = documented(  # None: the kind's trainer default (DraftTrainConfig / Eagle3TrainConfig)
        None,
        "with --draft: training steps at most (default: draft-train's, 400; eagle3 2000)",
        shown="the kind's (400; eagle3 2000)",
    )
    time_budget_s: float | None = documented(
        DRAFT_TIME_BUDGET_S, "with --draft auto: training seconds at most (eagle3: the whole run, data included)"
    )
    trim_keep: int | None = documented(
        None, "with --draft auto: also a VocabTrim draft keeping N tokens; eagle3: the head's draft vocabulary"
    )
    gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    temperature: float = 0.0  # the temperature the recommendation is for
    num_prompts: int = 8  # held-out prompts measured
    max_tokens: int = 64  # tokens generated per measured prompt
    device_memory: str | None = None  # add a memory plan for a device this size
    seed: int = 0
    train: dict = field(default_factory=dict)  # extra trainer fields


def _train(cfg: DraftBundleConfig, target_dir: Path, draft_dir: Path, device: str, progress):
    """The draft (or EAGLE-3 head) of the bundle, trained into draft_dir; its summary."""
    from fp8ptq.draft.train import DraftTrainConfig, draft_train

    common = dict(target=str(target_dir), output=draft_dir, time_budget_s=cfg.time_budget_s)
    if cfg.max_steps is not None:
        common["max_steps"] = cfg.max_steps
    common |= dict(seed=cfg.seed, device=device, **cfg.train)
    if cfg.kind == "eagle3":
        from fp8ptq.draft.eagle3_train import Eagle3TrainConfig, eagle3_train

        vocab = {} if cfg.trim_keep is None else {"draft_vocab": cfg.trim_keep}
        return eagle3_train(Eagle3TrainConfig(**common, **vocab), progress)
    return draft_train(DraftTrainConfig(**common, layers=cfg.layers), progress)


def _recommend(cfg: DraftBundleConfig, target_dir: Path, out_dir: Path, token_map: str | None, device, progress):
    """The draft measured on the target and γ chosen, into out_dir/speculative (spec.run.recommend)."""
    from fp8ptq.spec.run import MeasureConfig, RecommendConfig, recommend

    measure = MeasureConfig(
        target=str(target_dir),
        draft=str(out_dir / "draft"),
        gammas=tuple(cfg.gammas),
        temperatures=(float(cfg.temperature),),
        num_prompts=cfg.num_prompts,
        max_tokens=cfg.max_tokens,
        seed=cfg.seed,
        device=device,
    )
    rc = RecommendConfig(
        output=out_dir / "speculative",
        temperature=cfg.temperature,
        draft_for_engine="draft",
        token_map=token_map,
        device_memory=cfg.device_memory,
        measure=measure,
    )
    return recommend(rc, progress)


def build_draft_bundle(
    target_dir: Path, out_dir: Path, cfg: DraftBundleConfig | None = None, *, device: str = "cpu", progress=None
) -> Speculative:
    """Train (and trim) a draft for the finished checkpoint TARGET_DIR, measure it, write the engine
    configs beside it in OUT_DIR; the manifest's `speculative` part."""
    cfg = cfg or DraftBundleConfig()
    from fp8ptq.draft.trim import TOKEN_MAP, DraftTrimConfig, draft_trim
    from fp8ptq.manifest import SpecChoice, SpecFiles, Speculative
    from fp8ptq.spec.proposers import DraftModelProposer, Eagle3Proposer
    from fp8ptq.spec.run import check_gammas

    check_gammas(cfg.gammas)
    kind, trim_keep = cfg.kind, cfg.trim_keep
    if kind not in KINDS:
        raise SpecError(f"unknown draft kind '{kind}'", fix="use model (a small draft LLM) or eagle3 (an EAGLE-3 head)")
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    draft_dir = out_dir / "draft"
    meta = _train(cfg, target_dir, draft_dir, device, progress)
    eagle3 = kind == "eagle3"
    proposer = Eagle3Proposer if eagle3 else DraftModelProposer  # "draft" is relative to the bundle: unread
    timings = {"draft_train_s": time.perf_counter() - t0}
    trimmed = None
    if trim_keep and not eagle3:  # an EAGLE-3 head is trimmed as it is trained
        t = time.perf_counter()
        trim = DraftTrimConfig(
            draft=draft_dir,
            target=str(target_dir),
            keep=trim_keep,
            output=out_dir / "draft-trimmed",
            seed=cfg.seed,
            device=device,
        )
        trimmed = draft_trim(trim, progress)
        timings["draft_trim_s"] = time.perf_counter() - t
    t = time.perf_counter()
    rec = _recommend(cfg, target_dir, out_dir, f"draft-trimmed/{TOKEN_MAP}" if trimmed else None, device, progress)
    timings["measure_recommend_s"] = time.perf_counter() - t
    # The engine files sit at the top of the folder, beside the target they belong to.
    for name in ("speculative_config.json", "sglang_flags.txt"):
        shutil.copy2(out_dir / "speculative" / name, out_dir / name)
    return Speculative(
        draft=meta.file_json(),
        trimmed=None if trimmed is None else to_json(trimmed),
        recommendation=SpecChoice(
            gamma=rec.gamma,
            tau=rec.tau,
            speedup=rec.speedup,
            c=rec.costs["c"],
            costs_source=rec.costs["source"],
            worth_it=rec.worth_it,
            table=rec.table,
        ),
        kind=kind,
        speculative_config=vllm_config("draft", rec.gamma, proposer=proposer),
        sglang_flags=sglang_flags(
            "draft", rec.gamma, f"draft-trimmed/{TOKEN_MAP}" if trimmed else None, proposer=proposer
        ),
        files=SpecFiles(
            draft="draft",
            trimmed="draft-trimmed" if trimmed else None,
            vllm="speculative_config.json",
            sglang="sglang_flags.txt",
            recommendation="speculative/recommendation.json",
            plot="speculative/speculative.png",
        ),
        timings={**timings, "total_s": time.perf_counter() - t0},
    )
