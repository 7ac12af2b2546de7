"""Run a benchmark command in a fresh parent process so its peak RSS (ru_maxrss of the parent's
children) is that command's alone, not the benchmark driver's or an earlier child's."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = (
    "import json, resource, subprocess, sys, time; t = time.perf_counter(); "
    "r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
    "sys.stderr.write(r.stderr[-3000:]); print(r.stdout); "
    "print(json.dumps({'rc': r.returncode, 'wall': time.perf_counter() - t, "
    "'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))"
)


def child(cmd: list[str], env: dict | None = None) -> tuple[dict, list[str], str]:
    """Run cmd: ({rc, wall s, peak RSS MiB of cmd alone}, cmd's stdout lines, cmd's stderr tail)."""
    p = subprocess.run([sys.executable, "-c", _PROBE, *cmd], capture_output=True, text=True, env=env)
    lines = p.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1]).strip().splitlines(), p.stderr
