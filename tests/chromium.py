"""Headless Chromium for report tests (Debian's chromium, installed by `make test` when absent)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium not found: `make test` installs Debian's chromium (apt-get install chromium)"
    return exe


def _run(args: list[str]) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120
        )


def dump_dom(page: Path) -> str:
    r = _run(["--dump-dom", page.resolve().as_uri()])
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def screenshot(page: Path, png: Path, width: int = 1100, height: int = 3000) -> Path:
    r = _run([f"--window-size={width},{height}", f"--screenshot={png}", page.resolve().as_uri()])
    assert r.returncode == 0 and png.is_file(), r.stderr[-2000:]
    return png
