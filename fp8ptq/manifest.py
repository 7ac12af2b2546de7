"""`fp8ptq_manifest.json`: what a quantize run did, typed. The CLI, the gates and the report read it as
attributes; on disk it is strict JSON (a NaN or inf is an error, never written).

Two parts stay free-form dicts: per-layer reports (`layers`: each Linear's entry carries what its scheme
and calibration produced — errors, input abs-max, clip ratio, scheme, transforms — which differs by
recipe) and `recipe` (the Recipe as run, which the recipe layer above validates: `Recipe(**recipe)`).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import BaseModel, ConfigDict

from fp8ptq.errors import Fp8ptqError
from fp8ptq.gates import GateResult
from fp8ptq.io import write_json_atomic
from fp8ptq.results import read_json

MANIFEST = "fp8ptq_manifest.json"
MODEL_FREE_RECORD = "model_free.json"  # what `model-free` writes where `quantize` writes MANIFEST


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CalibrationImages(_Part):
    source: str  # the --images file
    samples: int  # image+text samples: the first of `samples`
    own_arguments: bool  # their layers took image-dependent masks/positions (each sample calibrated alone)


class CalibrationData(_Part):
    source: str
    samples: int
    seq_len: int
    tokens: int
    seed: int
    images: CalibrationImages | None = None  # written only when present (text-only manifests unchanged)


class RunInfo(_Part):
    device: str
    world_size: int
    resumed_from_layer: int | None
    offload_activations: bool
    chunk_tokens: int
    chunks_per_rank: list[int] | None
    compute_dtype: str | None = None  # the calibration passes' arithmetic (None: data-free)


class Sizes(_Part):
    source: int
    output: int
    weight_bits: float | None = None  # stored bits per weight of the quantized Linears (eval/bits.py)

    @property
    def ratio(self) -> float | None:
        return self.output / self.source if self.source else None


class Summary(_Part):
    layers: int
    linears_quantized: int
    linears_skipped: dict[str, str]
    worst_linear_rel_err: float


class MixedGroup(_Part):
    """One fused group of a mixed recipe's plan: its Linears, their FLOPs, how much 4 bits would hurt."""

    modules: list[str]
    flops: int
    sensitivity: float  # output error (or KL) of 4 vs 8 bits
    bits: int  # what the plan chose


class MixedPlanReport(_Part):
    """The 4/8-bit plan of a mixed recipe (calibrate/mixed.py)."""

    sensitivity: str  # output | kl
    int4_fraction_target: float
    int4_flop_share: float
    groups: list[MixedGroup]


class LmHeadReport(_Part):
    """The quantized LM head (scheme.lm_head; export/writer.py)."""

    weight_rel_err: float
    source: str  # the stored tensor it was quantized from (the embedding when tied)
    tied: bool


class QualityMetrics(_Part):
    """One text's numbers: mean KL(reference || candidate) and top-1 agreement per scored token, and both
    perplexities, over `tokens` next-token predictions of `data`."""

    tokens: int
    ppl_reference: float
    ppl: float
    kl: float
    top1: float
    data: str


class Quality(QualityMetrics):
    """The quality check of a quantize run (and, extended, `eval quality`'s result: eval/quality.py)."""

    numerics: dict  # what the evaluator simulated (eval.quality.load_simulated)


class GateRecord(_Part):
    gate: str
    metric: str
    op: str
    threshold: float
    value: float | None
    passed: bool
    margin: float | None

    @classmethod
    def of(cls, result: GateResult) -> GateRecord:
        return cls(**result.as_dict())


class SpecChoice(_Part):
    """The γ a `quantize --draft` bundle recommends, in short (its spec/recommendation.json has it all)."""

    gamma: int
    tau: float
    speedup: float
    c: float  # draft step cost / target step cost
    costs_source: str
    worth_it: bool
    table: list[dict]  # per γ: tau, speedup, alpha


class SpecFiles(_Part):
    """The bundle's files, relative to the checkpoint folder."""

    draft: str
    trimmed: str | None
    vllm: str
    sglang: str
    recommendation: str
    plot: str


class Speculative(_Part):
    """`quantize --draft`'s bundle (fp8ptq.draft.auto.build_draft_bundle)."""

    draft: dict  # the trainer's summary as its own file holds it (schema draft-train or eagle3-train)
    trimmed: dict | None  # draft-trim's summary (schema draft-trim), when a VocabTrim draft was made
    recommendation: SpecChoice
    kind: str  # model | eagle3
    speculative_config: dict  # vLLM's, paths relative to the folder
    sglang_flags: list[str]
    files: SpecFiles
    timings: dict[str, float]


_OMITTED_WHEN_NONE = ("mixed", "lm_head", "speculative", "quality")


class Manifest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    SCHEMA: ClassVar[str] = "manifest"  # on disk with schema_version first (fp8ptq/results.py)
    SCHEMA_VERSION: ClassVar[int] = 1

    model: str
    recipe: dict  # the recipe as run, command-line overrides applied (Recipe.model_dump(mode="json"))
    versions: dict[str, str]
    calibration: CalibrationData | None  # None: data-free
    run: RunInfo
    shards: list[str]
    size_bytes: Sizes
    layers: list[dict]
    summary: Summary
    mixed: MixedPlanReport | None = None  # the 4/8-bit plan (mixed recipes)
    lm_head: LmHeadReport | None = None  # the quantized LM head's numbers (scheme.lm_head)
    speculative: Speculative | None = None  # quantize --draft
    quality: Quality | None = None  # the quality check (--eval-samples > 0)
    timings: dict[str, float] = {}
    gates: list[GateRecord] = []
    gates_skipped: list[str] = []  # recipe gates that need the quality check, which was off

    def metrics(self) -> dict[str, float]:
        """The gateable numbers of the run (fp8ptq.gates.QUANTIZE_METRICS)."""
        out: dict[str, float] = {"worst_linear_rel_err": self.summary.worst_linear_rel_err}
        if self.size_bytes.ratio is not None:
            out["size_ratio"] = self.size_bytes.ratio
        if self.size_bytes.weight_bits is not None:
            out["weight_bits"] = self.size_bytes.weight_bits
        q = self.quality
        if q is not None:
            out.update(kl=q.kl, top1=q.top1, ppl=q.ppl, ppl_ratio=q.ppl / q.ppl_reference)
        return out

    def as_json(self) -> dict:
        data = {"schema": self.SCHEMA, "schema_version": self.SCHEMA_VERSION, **self.model_dump(mode="json")}
        for key in _OMITTED_WHEN_NONE:
            if data[key] is None:
                del data[key]
        if data["calibration"] is not None and data["calibration"]["images"] is None:
            del data["calibration"]["images"]
        return data

    def write(self, out_dir: Path) -> None:
        try:
            write_json_atomic(Path(out_dir) / MANIFEST, self.as_json(), trailing_newline=True)
        except ValueError as err:  # NaN / inf: a broken number must not reach a file as invalid JSON
            raise Fp8ptqError(
                f"the manifest holds a non-finite number ({err})",
                fix="report this run: fp8ptq should have refused its input earlier",
            ) from None

    @classmethod
    def load(cls, out_dir: Path) -> Manifest:
        """The manifest of an fp8ptq output, validated: a typed error naming the file and the bad field."""
        return read_json(
            Path(out_dir) / MANIFEST, cls, error=Fp8ptqError, fix="pass a directory written by `fp8ptq quantize`"
        )
