"""SGLang's own code over what fp8ptq writes for it (issue 38): its server argument parser over every set of
flags `spec recommend` emits, and its models' EAGLE-3 capture rule over the layer ids a head declares.
SGLang 0.5.23 lives in `.sglang-site` (`make sglang`: the wheel and the few packages .venv-vllm lacks,
installed without dependencies on top of .venv-vllm's torch) and runs in a subprocess of .venv-vllm's
python with that folder first on its path (`sglang_worker.py`, JSON out).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from fp8ptq.engine.vllm import EngineError, vllm_python

WORKER = Path(__file__).with_name("sglang_worker.py")
REPO_SITE = Path(__file__).resolve().parents[2] / ".sglang-site"


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
    those eagle_config ids -> {"capture": [{..., "layers_to_capture"}]}. Both carry SGLang's "version"."""
    where = sglang_site(site)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(where), os.environ.get("PYTHONPATH", "")])}
    cmd = [str(vllm_python()), str(WORKER)]
    proc = subprocess.run(cmd, input=json.dumps(job), capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise EngineError(
            f"SGLang's code did not run (exit {proc.returncode}): {proc.stderr.strip()[-800:]}",
            fix="re-run `make sglang`",
        )
    return json.loads(lines[-1])
