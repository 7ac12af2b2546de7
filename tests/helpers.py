"""Small helpers the tests share (importable as `helpers`: tests/ is on sys.path through conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def vllm_venv_prints(script: str, **env: str) -> str:
    """Run `script` in .venv-vllm's python with the repository importable (and `env` added); assert it
    exits 0 and return the last line it printed (the check's verdict)."""
    import os

    from fp8ptq.engine.vllm import vllm_python

    r = subprocess.run(
        [str(vllm_python()), "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The directory `name`, filled by build(directory) once per test session: under pytest-xdist (`make
    test` runs two workers) once for all workers, in the base temp directory they share. The first worker
    to ask builds it under a file lock; another asking meanwhile waits, then reuses it. A build that raised
    leaves no `.built` mark: the next asker builds again (and fails with its own error)."""
    import fcntl
    import os
    import shutil

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # xdist: each worker's base temp is popen-gwN inside the session's
    shared = root / "built-once"
    shared.mkdir(exist_ok=True)
    d = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (d / ".built").is_file():
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir()
            build(d)
            (d / ".built").touch()
    return d


def ct017_site() -> Path:
    return REPO / ".venv" / "ct017"


def engine_recipe(directory: Path, name: str, **calibration) -> str:
    """A built-in recipe written to `directory` as YAML, INT8 weights limited to 7-bit codes on CPUs whose
    INT8 GEMM saturates without VNNI (fp8ptq.engine.vllm.int8_gemm_exact; tests/e2e/test_vllm_real.py
    measures why), so vLLM-cpu computes what fp8ptq simulates on AVX2 and AVX-512 alike. Returns its path."""
    import yaml

    from fp8ptq.engine.vllm import int8_gemm_exact
    from fp8ptq.recipe import load_recipe

    r = load_recipe(name).model_dump(mode="json")
    if not int8_gemm_exact() and r["scheme"]["weights"]["type"] == "int":  # INT4 ignores it
        r["calibration"]["weight_code_bits"] = 7
    r["calibration"].update(calibration)
    f = Path(directory) / f"{name}.yaml"
    f.write_text(yaml.safe_dump(r))
    return str(f)


def assert_no_w4a16_kernel(run) -> None:
    """vLLM-cpu without AVX-512 loaded a W4A16 checkpoint's INT4 weights, then had no W4A16 kernel
    (`cpu_gemm_wna16` is only in its AVX-512 build) to run them: the format is accepted, the CPU lacks it."""
    assert not run.ok and run.stage == "generate" and "cpu_gemm_wna16" in run.error, run.error


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def crash_at_checkpoint(monkeypatch, checkpoint: int) -> None:
    """Make a quantize run die just before its state names `checkpoint` (RunDir.save_state): the window
    where activations are on disk but not yet recorded. monkeypatch.undo() (or a new setattr) ends it."""
    from fp8ptq.export.rundir import RunDir

    real = RunDir.save_state

    def save_state(self, **updates):
        if updates.get("checkpoint") == checkpoint:
            raise RuntimeError(f"simulated kill before the state names checkpoint {checkpoint}")
        real(self, **updates)

    monkeypatch.setattr(RunDir, "save_state", save_state)


def read_tensors(path: Path) -> dict:
    """Every tensor of a checkpoint directory, from all its safetensors shards."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


_PARSE = r"""
import json, sys
import compressed_tensors
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
out = {}
for key, d in json.load(sys.stdin).items():
    try:
        QuantizationConfig.model_validate(d)
        for g in d["config_groups"].values():                 # what vLLM's CompressedTensorsConfig does
            for k in ("weights", "input_activations"):
                if g.get(k) is not None:
                    QuantizationArgs.model_validate(g[k])
        if d.get("kv_cache_scheme"):
            QuantizationArgs.model_validate(d["kv_cache_scheme"])
        out[key] = "ok " + compressed_tensors.__version__
    except Exception as err:
        out[key] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def parse_configs_under(configs: dict[str, dict], ct: str) -> dict[str, str]:
    """Parse quantization_configs (key -> config) with compressed-tensors `ct` ('0.17.0': vLLM-cpu's pin,
    installed in .venv/ct017 by `make test`; 'installed': fp8ptq's own), in one subprocess (an import
    of compressed-tensors costs seconds). Returns key -> 'ok VERSION' or the error it raised."""
    env = None
    if ct == "0.17.0":
        site = ct017_site()
        assert (site / "compressed_tensors").is_dir(), "run `make test` (it installs compressed-tensors 0.17.0 there)"
        env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-c", _PARSE], input=json.dumps(configs), capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def parse_config_under(qc: dict, ct: str) -> str:
    """One config: the compressed-tensors version that parsed it (AssertionError with its message if not)."""
    got = parse_configs_under({"c": qc}, ct)["c"]
    assert got.startswith("ok "), got
    return got[3:]


def write_gguf(hf_dir: Path, out: Path, types: dict[str, str], default: str = "F16", edit=None) -> Path:
    """A GGUF of the float HF model in `hf_dir`, written in-process with gguf-py's GGUFWriter and its own
    quantizers (gguf.quants.quantize): `types` maps a substring of an HF tensor name to a GGML type
    (first match wins; 1-D tensors are F32). Names, q/k row order, metadata and tokenizer come from
    fp8ptq.conversion.gguf_meta; transformers reading the file back checks them independently."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from fp8ptq.conversion.gguf_meta import add_metadata, gguf_arch, name_map, to_gguf_rows
    from fp8ptq.models.loader import open_hf_dir

    src = open_hf_dir(hf_dir)
    to_gguf = name_map(src.config)
    writer = GGUFWriter(str(out), gguf_arch(src.config))
    add_metadata(writer, src.config, hf_dir, "tiny")
    for name in src.weight_map:
        t = to_gguf_rows(name, src.tensor(name).float(), src.config).numpy()
        kind = "F32" if t.ndim == 1 else next((v for k, v in types.items() if k in name), default)
        if kind in ("F32", "F16"):
            writer.add_tensor(to_gguf(name), t.astype(np.float32 if kind == "F32" else np.float16))
        else:
            qt = GGMLQuantizationType[kind]
            blocks = quants.quantize(t, qt)
            if edit is not None:  # plant a defect in the raw blocks: edit(name, blocks) in place
                edit(name, blocks)
            writer.add_tensor(to_gguf(name), blocks, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


QUICK = ["--num-samples", "2", "--seq-len", "32", "--eval-samples", "0", "--no-recipe-gates", "--weights", "rtn"]


def run_cli(*args) -> tuple[int, str]:
    """`fp8ptq ARGS...` in process (typer's CliRunner): (exit code, output)."""
    from typer.testing import CliRunner

    from fp8ptq.cli import app

    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.output


def assert_one_line_error(rc: int, output: str, *phrases: str) -> str:
    """Exit 2, exactly one `error:` line holding every phrase, no traceback. Returns the line."""
    assert rc == 2, output
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(p in errors[0] for p in phrases), output
    assert "Traceback" not in output, output
    return errors[0]


def quantize_recording(cfg) -> dict:
    """fp8ptq.api.quantize(cfg), returning {module: the fake-quant fp32 weight calibration simulated} for
    every Linear it wrote (data-free FP8 packs: codes x scale), recorded at the writer."""
    import torch

    from fp8ptq.api import quantize
    from fp8ptq.export.writer import CheckpointWriter

    fakes: dict[str, torch.Tensor] = {}
    real = CheckpointWriter.layer_tensors

    def record(self, res):
        fakes.update({m: q.weight.clone() for m, q in res.linears.items()})
        for m, (t, _) in res.packed.items():  # data-free FP8: codes straight from the source
            scale = t["weight_scale"].float()
            fakes[m] = t["weight"].float() * (scale if scale.numel() > 1 else scale.reshape(1, 1))
        return real(self, res)

    CheckpointWriter.layer_tensors = record
    try:
        quantize(cfg)
    finally:
        CheckpointWriter.layer_tensors = real
    return fakes


def decompression_mismatches(out: Path, fakes: dict) -> list[str]:
    """Modules of export `out` that compressed-tensors' own compressors do not decompress to exactly the
    recorded simulated weight (or that no config group targets), by name; [] when all match."""
    import torch
    from compressed_tensors.quantization import QuantizationConfig

    from fp8ptq.eval.quality import group_scheme_for, load_simulated
    from fp8ptq.export.compressed_tensors import decompress_linear
    from fp8ptq.models.loader import open_hf_dir
    from fp8ptq.quantization.schemes import stored_tensors

    src = open_hf_dir(out)
    qcfg = QuantizationConfig.model_validate(read_config(out)["quantization_config"])
    modules = dict(load_simulated(src, simulate=False).model.named_modules())
    bad = []
    for name, fake in fakes.items():
        scheme = group_scheme_for(name, modules[name], qcfg)
        if scheme is None:
            bad.append(f"{name}: quantized but no config group targets it")
            continue
        fmt = scheme.format or qcfg.format
        local = {k: src.tensor(f"{name}.{k}") for k in stored_tensors(scheme, fmt)}  # each must be there
        if not torch.equal(decompress_linear(local, scheme, fmt), fake.float()):
            bad.append(f"{name}: differs")
    return bad


def mx_rtn(w, choose_scale, fake_quant, mse: bool = False):
    """Round-to-nearest of w [out, in] on an MX grid (ops.mx): (fake-quant weight, scales [out, in / 32])."""
    from fp8ptq.ops.mx import MX_GROUP

    groups = w.reshape(-1, MX_GROUP)
    s = choose_scale(groups, mse)
    return fake_quant(groups, s).reshape(w.shape), s.reshape(w.shape[0], -1)


def mx_round_trip(fmt: str, args, fake, scale, stored: dict):
    """An MX format's compressed-tensors compressor on (fake-quant weight, power-of-two scales): checks it
    stores exactly the tensors `stored` ({name: (dtype, shape)}) and the scales as E8M0 exponents holding
    them exactly; returns its decompression (fp32)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    comp = BaseCompressor.get_value_from_registry(fmt)
    packed = comp.compress({"weight": fake, "weight_scale": scale}, scheme)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in packed.items()} == stored, packed.keys()
    assert torch.equal(torch.exp2(packed["weight_scale"].float() - 127), scale)  # E8M0 holds it exactly
    return comp.decompress(dict(packed), scheme)["weight"].float()


def transform_each_layer(model_ref: str, recipe, samples: tuple[int, int], transform) -> tuple[float, list]:
    """Run the float model layer by layer through the calibration code (prepare, observe_layer with the
    transforms' StatsSpec), apply transform(layer, index, prefix, stats, src, result) -> report to each
    layer, and measure how far it moved the layer's output (fp32). Returns (worst max relative layer-output
    difference, the per-layer reports); the next layer reads the untransformed output."""
    import copy

    import torch

    from fp8ptq.calibrate.state import CalibrationSetup, observe_layer, prepare
    from fp8ptq.calibrate.transforms import SMOOTH_ROWS
    from fp8ptq.data import load_samples
    from fp8ptq.models.loader import resolve_model
    from fp8ptq.models.skeleton import materialize, release
    from fp8ptq.outliers.stats import StatsSpec
    from fp8ptq.quantization.results import LayerResult

    src = resolve_model(model_ref)
    ids = load_samples("builtin", src.tokenizer(), *samples, "calibration", 0)
    model, state = prepare(src, ids, CalibrationSetup(recipe, chunk_samples=2))
    worst, reports = 0.0, []
    try:
        for i, layer in enumerate(src.arch.decoder_layers(model)):
            prefix = src.arch.layer_prefix(i)
            materialize(layer, prefix, src, torch.float32, state.device)
            before = copy.deepcopy(layer)
            stats = observe_layer(layer, i, state, StatsSpec(rows=SMOOTH_ROWS), kv=False)
            reports.append(transform(layer, before, prefix, stats, src, LayerResult(i, prefix)))
            with torch.inference_mode():
                for _, first, x in state.each_chunk():
                    a, b = state.run_layer(before, i, x), state.run_layer(layer, i, x)
                    worst = max(worst, float((a - b).abs().max() / a.abs().max()))
                    state.write(first, a)
            release(layer)
    finally:
        state.store.close()
    return worst, reports
