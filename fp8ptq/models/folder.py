"""A checkpoint is a closed folder: every file name read from its own files (an index, a config) must
resolve, symlinks followed, inside the model folder or its Hugging Face cache entry; and so must every
side file fp8ptq or transformers reads from it (tokenizer, chat template, configs) and every file an
export copies, each a regular file of bounded size (`side_files`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from fp8ptq.errors import ModelError


def cache_root() -> Path:
    """fp8ptq's cache (converted GGUF models, rotated models): FP8PTQ_CACHE, else ~/.cache/fp8ptq."""
    return Path(os.environ.get("FP8PTQ_CACHE", Path.home() / ".cache" / "fp8ptq"))


def model_roots(path: Path) -> tuple[Path, ...]:
    """The folders a checkpoint's files may live in, symlinks resolved: the model folder itself and, for
    a Hugging Face cache snapshot (…/models--org--name/snapshots/REV, whose files are links into
    …/models--org--name/blobs), that repository's cache entry."""
    root = path.resolve()
    roots = [root]
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        roots.append(root.parent.parent)
    return tuple(roots)


def inside_model(path: Path, name: str, what: str) -> Path:
    """`path / name` for a file name read from a checkpoint's own files (an index, a config), or a
    ModelError when it is absolute or resolves (symlinks followed) outside the model folder: a hostile
    index must not make fp8ptq read, and export, another folder's tensors."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ModelError(f"{what} names {name!r}, which is not a file name", fix="repair or re-download the model")
    f = path / name
    target = f.resolve()
    if Path(name).is_absolute() or not any(target == r or r in target.parents for r in model_roots(path)):
        raise ModelError(
            f"{what} names '{name}', which lies outside the model folder '{path}'",
            fix="use a checkpoint whose files are all inside its folder (a hostile or broken download?)",
        )
    return f


# the largest side file read or copied: a 262,144-token tokenizer.json is 33 MB
SIDE_FILE_BYTES = 256 << 20
NOT_SIDE_FILES = (".safetensors", ".gguf", ".bin", ".pt", ".pth", ".ckpt", ".pkl")  # weights


def side_files(path: Path) -> list[Path]:
    """The top-level files of a model folder other than its weights (tokenizer and its chat template,
    generation and processor configs, READMEs), each checked as transformers would read it and an export
    would copy it: a ModelError unless it resolves inside the folder (symlinks followed), is a regular
    file (a FIFO would block the read, a device never end) and holds at most SIDE_FILE_BYTES. Hidden
    files, subfolders and other weight files (pickles, GGUF: never read, never copied) are left out."""
    out = []
    for f in sorted(path.iterdir()):
        if f.name.startswith(".") or f.suffix in NOT_SIDE_FILES:  # shards: read_weight_map's checks
            continue
        if f.is_dir():  # subfolders (or links to folders) are neither read nor copied
            continue
        target = f.resolve()
        if not any(target == r or r in target.parents for r in model_roots(path)):
            raise ModelError(
                f"'{f}' links to '{target}', outside the model folder",
                fix="copy the file into the folder (a checkpoint's files must all be inside it); fp8ptq never "
                "reads or exports a file from elsewhere",
            )
        st = f.stat()
        if not stat.S_ISREG(st.st_mode):
            raise ModelError(f"'{f}' is not a regular file (a FIFO, device or folder)", fix="remove it from the model")
        if st.st_size > SIDE_FILE_BYTES:
            raise ModelError(
                f"'{f}' is {st.st_size:,} bytes (limit {SIDE_FILE_BYTES:,} for a model's side file)",
                fix="remove it from the model folder, or move it elsewhere",
            )
        out.append(f)
    return out
