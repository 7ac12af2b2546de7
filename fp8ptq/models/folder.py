"""A checkpoint is a closed folder: every file name read from its own files (an index, a config) must
resolve, symlinks followed, inside the model folder or its Hugging Face cache entry."""

from __future__ import annotations

from pathlib import Path

from fp8ptq.errors import ModelError


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
