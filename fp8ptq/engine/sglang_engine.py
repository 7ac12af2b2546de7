"""SGLang's own code over what fp8ptq writes for it: its server argument parser over every set of
flags `spec recommend` emits, its models' EAGLE-3 capture rule over the layer ids a head declares, and its
compressed-tensors config classes over a checkpoint's quantization_config (`inspect --engine sglang`: the
scheme SGLang picks per GPU generation, or its refusal).
SGLang 0.5.23 lives in `.sglang-site` (`make sglang`: the wheel and the few packages .venv-vllm lacks,
installed without dependencies on top of .venv-vllm's torch) and runs in a subprocess of .venv-vllm's
python with that folder first on its path (`sglang_worker.py`, JSON out), then `standins/` (import-only
torchvision and sgl_kernel: standins/standin.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from fp8ptq.engine.vllm import EngineError, vllm_python

WORKER = Path(__file__).with_name("sglang_worker.py")
REPO_SITE = Path(__file__).resolve().parents[2] / ".sglang-site"
STANDINS = Path(__file__).with_name("standins")
SGLANG_VERSION = "0.5.23"
# The GPU generations `inspect --engine sglang` asks SGLang about: capability -> an example GPU
GPUS = {(8, 0): "A100", (8, 9): "L40S", (9, 0): "H100", (10, 0): "B200"}


def sglang_site(explicit: str | None = None) -> Path:
    """The folder holding SGLang: explicit, $FP8PTQ_SGLANG_SITE, or the repository's .sglang-site."""
    p = Path(explicit or os.environ.get("FP8PTQ_SGLANG_SITE") or REPO_SITE)
    if not (p / "sglang" / "srt" / "server_args.py").is_file():
        raise EngineError(
            f"no SGLang at '{p}'",
            fix="run `make sglang` (SGLang 0.5.23 into .sglang-site, beside .venv-vllm) or set FP8PTQ_SGLANG_SITE",
        )
    return p


def run_checks(job: dict, *, site: str | None = None, timeout: float = 300) -> dict:
    """One SGLang subprocess (its import takes ~10 s) over a job of `sglang_worker.py`:

    {"flags": {name: [flags]}}: each set parsed (after `--model-path MODEL`) by SGLang's own
    `ServerArgs.add_cli_args` parser -> {"flags": {name: {"ok", "error": SGLang's message, "parsed":
    {dest: value} of what differs from the defaults}}};
    {"capture": [{"file", "class", "num_layers", "ids"}]}: SGLang's own set_eagle3_layers_to_capture on
    those eagle_config ids -> {"capture": [{..., "layers_to_capture"}]};
    {"schemes": [{"name", "config", "layers", "capabilities"}]}: SGLang's CompressedTensorsConfig over a
    quantization_config -> {"schemes": [{"name", "kv_supported", "by_capability": {"9.0": {layer: {"scheme",
    "min_capability"} or {"error"}}}}]};
    {"eagle3": {"path"}}: an EAGLE-3 head loaded by SGLang's LlamaForCausalLMEagle3 on CPU -> {"eagle3":
    {"unloaded", "loaded_numel", "file_numel", "qkv_equal", "hot_token_id"}};
    {"generate": {"model", "prompts", "max_new_tokens", "dtype"}}: SGLang's offline Engine on CPU, greedy ->
    {"generate": {"output_ids", "start_s"}} (a float model: SGLang's quantized schemes have no CPU path).
    All carry SGLang's "version"."""
    where = sglang_site(site)
    path = [str(where), str(STANDINS), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if "generate" in job:  # SGLang's CPU engine (its own switch); the other checks resolve as for a GPU
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    cmd = [str(vllm_python()), "-P", str(WORKER)]  # -P: not its own folder first (engine/vllm.py is not vllm)
    proc = subprocess.run(cmd, input=json.dumps(job), capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise EngineError(
            f"SGLang's code did not run (exit {proc.returncode}): {proc.stderr.strip()[-800:]}",
            fix="re-run `make sglang`",
        )
    return json.loads(lines[-1])


def sglang_findings(model: Path, *, site: str | None = None) -> list[tuple[str, str, str, str]]:
    """`inspect --engine sglang`: SGLang's own scheme resolution of the checkpoint's quantization_config for
    each quantized Linear (a module with a `weight_scale` tensor), on each GPU generation of GPUS, as
    findings: info per generation (scheme class x Linears, its minimum capability), an error where SGLang
    refuses a Linear on every generation (its own message), a warning where it refuses on some, and a
    warning where its KV-cache method ignores the kv_cache_scheme (it serves static per-tensor FP8 scales
    only and warns). Each finding is (level, code, where, message), inspect's Finding fields."""
    from collections import Counter

    from fp8ptq.models.loader import open_hf_dir

    src = open_hf_dir(model)
    qc = json.loads((model / "config.json").read_text()).get("quantization_config")
    if not qc or qc.get("quant_method") != "compressed-tensors":
        return [("info", "sglang", "config.json", "no compressed-tensors quantization_config: nothing to resolve")]
    layers = sorted({n[: -len(".weight_scale")] for n in src.weight_map if n.endswith(".weight_scale")})
    job = {"name": str(model), "config": qc, "layers": layers, "capabilities": [list(c) for c in GPUS]}
    res = run_checks({"schemes": [job]}, site=site)["schemes"][0]
    out, refused = [], Counter()
    for (cap, gpu), by_layer in zip(GPUS.items(), res["by_capability"].values()):
        picked = Counter(
            f"{r['scheme']} (min capability {r['min_capability']})" if r["scheme"] else "unquantized"
            for r in by_layer.values()
            if "error" not in r
        )
        errors = {n: r["error"] for n, r in by_layer.items() if "error" in r}
        refused.update(errors.keys())
        parts = [f"{n} Linears {s}" for s, n in picked.items()] + ([f"{len(errors)} refused"] if errors else [])
        where = f"sm_{cap[0]}{cap[1]} ({gpu})"
        out.append(("info", "sglang-scheme", where, f"SGLang {SGLANG_VERSION}: " + ", ".join(parts)))
    everywhere = [n for n, k in refused.items() if k == len(GPUS)]
    if everywhere:
        first = res["by_capability"][next(iter(res["by_capability"]))][everywhere[0]]["error"]
        where = everywhere[0] + (f" (+{len(everywhere) - 1} more)" if len(everywhere) > 1 else "")
        out.append(("error", "sglang-refuses", where, f"SGLang {SGLANG_VERSION} refuses it on every GPU: {first}"))
    elif refused:
        where = next(iter(refused))
        out.append(("warning", "sglang-refuses", where, f"SGLang {SGLANG_VERSION} refuses it on some GPUs (above)"))
    if res["kv_supported"] is False:
        msg = f"SGLang {SGLANG_VERSION} reads static per-tensor FP8 KV scales only: it warns and ignores these"
        out.append(("warning", "sglang-kv", "kv_cache_scheme", msg))
    return out
