"""`fp8ptq push OUT REPO_ID`: an export uploaded as a Hub model repository with huggingface_hub.

What is uploaded is planned first and shown by `--dry-run` without a network: the export's regular files
(its model card README.md, weights, config, tokenizer, recipe, manifest, report and draft), never a hidden
file (a run's lock or partial folder), a symlink (it may point anywhere) or anything outside the folder.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from fp8ptq.errors import OptionError, OutputError
from fp8ptq.export.card import CARD
from fp8ptq.manifest import MANIFEST, MODEL_FREE_RECORD

RECORDS = (MANIFEST, MODEL_FREE_RECORD)  # what `quantize` and `model-free` write beside the card


@dataclass(frozen=True)
class PushPlan:
    folder: Path
    repo_id: str
    private: bool
    files: tuple[tuple[str, int], ...]  # (path relative to the folder, bytes), in upload order
    skipped: tuple[str, ...]  # symlinks and other non-files left out

    @property
    def total_bytes(self) -> int:
        return sum(n for _, n in self.files)


def plan_push(folder: Path, repo_id: str, private: bool = False) -> PushPlan:
    """What `push` would upload; OptionError for a repo id the Hub refuses, OutputError for a folder that
    is not a finished fp8ptq export."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        first = str(err).strip().splitlines()[0]
        raise OptionError(f"'{repo_id}' is not a Hub repository id ({first})", fix="use NAME or ORG/NAME") from None
    folder = Path(folder)
    record = any((folder / name).is_file() for name in RECORDS)
    if not record or not (folder / CARD).is_file():
        raise OutputError(
            f"'{folder}' is not a finished fp8ptq export (no {' / '.join(RECORDS)}, or no {CARD})",
            fix="push the folder `fp8ptq quantize -o` wrote (`fp8ptq report OUT` writes a missing card)",
        )
    files, skipped = [], []
    for root, dirs, names in os.walk(folder):  # os.walk does not follow symlinked folders
        rel_root = Path(root).relative_to(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        skipped += [str(rel_root / d) for d in dirs if (Path(root) / d).is_symlink()]
        dirs[:] = [d for d in dirs if not (Path(root) / d).is_symlink()]
        for name in sorted(names):
            if name.startswith("."):
                continue
            st = (Path(root) / name).lstat()
            if stat.S_ISREG(st.st_mode):
                files.append((str(rel_root / name), st.st_size))
            else:
                skipped.append(str(rel_root / name))
    files.sort(key=lambda f: (f[0] != CARD, f[0]))
    return PushPlan(folder, repo_id, private, tuple(files), tuple(sorted(skipped)))


def push(plan: PushPlan, token: str | None = None) -> str:
    """Create the repository (kept when it exists) and upload the planned files in one commit; returns the
    commit's URL. Whatever the Hub or the network answers instead is one OutputError line."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(plan.repo_id, repo_type="model", private=plan.private, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(plan.folder),
            repo_id=plan.repo_id,
            repo_type="model",
            allow_patterns=[name for name, _ in plan.files],
            commit_message="Upload an fp8ptq export",
        )
    except Exception as err:  # noqa: BLE001 - huggingface_hub raises HTTP, offline-mode and OS errors alike
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise OutputError(
            f"cannot push '{plan.folder}' to '{plan.repo_id}' ({type(err).__name__}: {first})",
            fix="log in (`hf auth login` or HF_TOKEN), unset HF_HUB_OFFLINE, or check the repository name",
        ) from None
    return str(getattr(info, "commit_url", info))
