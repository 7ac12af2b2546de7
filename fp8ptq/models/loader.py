"""Resolve what the user typed into a local HF directory with safetensors, and read it lazily.

Accepted: an HF model directory (model.safetensors or sharded with model.safetensors.index.json), a
.gguf file (dequantized once into a cache directory via transformers), or a built-in alias.
Pickle weights (.bin/.pt) are refused: loading them can run arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from fp8ptq.errors import ModelError, NonFiniteError
from fp8ptq.io import ST_DTYPES
from fp8ptq.models.arch import Arch, arch_for
from fp8ptq.models.arch.capture import stored_name
from fp8ptq.models.config_checks import check_architectures, check_sizes
from fp8ptq.models.folder import inside_model, side_files
from fp8ptq.models.gguf_files import ALIASES, alias_gguf, cached_gguf, gguf_cache_dir
from fp8ptq.models.views import JoinedView, PartView, View

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def ensure_offline() -> None:
    """Evaluation data is local: keep `datasets` (under lm-eval) from reaching for the hub. Models are
    not forced offline: a hub id downloads when the network is there (resolve_model); set
    HF_HUB_OFFLINE=1 to use only the local Hugging Face cache."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
# What a model needs from a hub repository: never pickle weights (*.bin, *.pt), never remote code.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "tokenizer*"]


def resolve_hub(repo_id: str, revision: str | None = None) -> Path:
    """A hub id -> its local snapshot directory: downloaded when the network is there (safetensors,
    configs and tokenizer files only), else the local Hugging Face cache (HF_HUB_OFFLINE=1: cache only)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"'{repo_id}'" + (f" at revision '{revision}'" if revision else "")
    try:
        return Path(snapshot_download(repo_id=repo_id, revision=revision, allow_patterns=HUB_FILES))
    except HFValidationError as err:
        raise ModelError(f"model {where} is not a valid hub id ({err})", fix="write it as org/name") from None
    except GatedRepoError:
        raise ModelError(
            f"model {where} is gated on the Hugging Face hub",
            fix="accept its licence on the hub and log in (`hf auth login` or HF_TOKEN), or pass a local directory",
        ) from None
    except RevisionNotFoundError:
        raise ModelError(f"model {where}: no such revision on the hub", fix="check --revision") from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"model {where} not found on the Hugging Face hub (or it is private)",
            fix="check the id, log in for a private repository (`hf auth login`), or pass a local directory",
        ) from None
    except LocalEntryNotFoundError:
        raise ModelError(
            f"model {where} is not in the local Hugging Face cache and the hub cannot be reached"
            + (" (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") else ""),
            fix="download it on a machine with a network (`hf download ID`), unset HF_HUB_OFFLINE, "
            "or pass a local directory",
        ) from None


@dataclass(eq=False)
class ModelSource:
    """A local HF model directory whose tensors are read one at a time (memory-mapped)."""

    path: Path
    label: str
    weight_map: dict[str, str]  # tensor name -> shard file name
    config: object
    # names the skeleton uses that the files store fused or split (Arch.source_views); the weight_map
    # lists these names instead of the stored ones, whose shards `stored_files` holds
    views: dict[str, View] = field(default_factory=dict)
    stored_files: dict[str, str] = field(default_factory=dict)
    # module name -> the name the files store it under, by transformers' own checkpoint renamings (the
    # generic adapter: `model.language_model.layers...` stored as `language_model.model.layers...`)
    renames: dict[str, str] = field(default_factory=dict)
    _handles: dict = field(default_factory=dict, repr=False)

    @property
    def arch(self) -> Arch:
        return arch_for(self.config)

    @property
    def text_config(self):
        """The language model's config (the config itself, or a multimodal checkpoint's text_config)."""
        return self.config.get_text_config()

    @property
    def num_layers(self) -> int:
        """The decoder layers the model's layer list holds (Arch.layer_count)."""
        return self.arch.layer_count(self.config)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _open(self, shard: str):
        """The shard's safetensors handle, opened once (memory-mapped) until `close`."""
        handle = self._handles.get(shard)
        if handle is None:
            handle = self._handles[shard] = safe_open(str(self.path / shard), framework="pt")
        return handle

    def _handle(self, name: str):
        return self._open(self.weight_map[name])

    def stored_name(self, name: str) -> str:
        """The name the files give the tensor the skeleton calls `name` (what an export writes): renamed
        tensors by their prefix, so a quantized Linear's scales and an attention's KV scales follow."""
        return stored_name(name, self.renames) if self.renames else name

    def stored_tensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Module-named tensors of an export (a quantized Linear's `weight_scale`, ... beside its weight)
        under the names and in the layout the source files use: renamed by `stored_name`, and those of a
        joined or split view written back as the files hold them (ModelError where a fused tensor's
        parts do not agree on a scale it has one of)."""
        out, fused = {}, {}
        for name, t in tensors.items():
            module, _, leaf = name.rpartition(".")
            view = self.views.get(name) or self.views.get(f"{module}.weight")
            if isinstance(view, JoinedView):
                shapes = [self.tensor_shape_of(p) for p in view.parts]
                out.update(view.write_back(name, t, shapes, whole=name in self.views))
            elif isinstance(view, PartView):
                fused.setdefault((view.stored, leaf), (view, {}))[1][name] = t
            else:
                out[self.stored_name(name)] = t
        for (_, leaf), (view, parts) in fused.items():
            out.update(view.write_back(leaf, parts))
        return out

    def tensor_shape_of(self, stored: str) -> tuple[int, ...]:
        """The shape of a tensor as the files store it (a view's source)."""
        return tuple(self._open(self.stored_files[stored]).get_slice(stored).get_shape())

    def _slices(self, name: str) -> list:
        """The stored tensors (safetensors slices) the tensor `name` is read from: itself, or its view's."""
        view = self.views.get(name)
        if view is None:
            return [self._handle(name).get_slice(self.stored_name(name))]
        return [self._open(self.stored_files[s]).get_slice(s) for s in view.sources]

    def tensor(self, name: str) -> torch.Tensor:
        view = self.views.get(name)
        if view is not None:
            return view.read(self._slices(name))
        return self._handle(name).get_tensor(self.stored_name(name))

    def tensor_dtype(self, name: str) -> torch.dtype:
        """The stored dtype of a tensor, read from the safetensors header (no data is loaded)."""
        return ST_DTYPES[self._slices(name)[0].get_dtype()]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of a tensor, from the safetensors header."""
        slices = self._slices(name)
        view = self.views.get(name)
        return tuple(slices[0].get_shape()) if view is None else view.shape([tuple(s.get_shape()) for s in slices])

    def tensor_bytes(self, name: str) -> int:
        """Stored size of a tensor, from the safetensors header."""
        return math.prod(self.tensor_shape(name)) * self.tensor_dtype(name).itemsize

    def close(self) -> None:
        """Drop the open (memory-mapped) shards: pages read through a live mapping stay in the process's
        RSS, so a run over many layers would otherwise grow with depth."""
        self._handles.clear()

    @property
    def shard_files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def size_bytes(self) -> int:
        return sum((self.path / s).stat().st_size for s in self.shard_files)

    def content_hash(self) -> str:
        """What --resume compares to notice weights changed in place with the same sizes: per shard (name
        order) its name, size, modification time (ns) and safetensors header (names, dtypes, shapes,
        offsets). Not a hash of every byte: that read the whole model once more before any work (1.3 s
        per GiB measured, minutes for a 70B model); rewriting a file sets its mtime, as make and rsync
        rely on."""
        h = hashlib.blake2b(digest_size=16)
        for shard in self.shard_files:
            path = self.path / shard
            st = path.stat()
            h.update(f"{shard}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
            with open(path, "rb") as f:
                head = f.read(8)
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                n = n if n <= min(st.st_size - 8, 100 << 20) else 0  # not safetensors: its stat alone
                h.update(head + f.read(n))  # the JSON header (safetensors caps it at 100 MB)
        return h.hexdigest()

    def tokenizer(self):
        """The model's own tokenizer (never its remote code), or a one-line ModelError."""
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(self.path), trust_remote_code=False)
        except (ValueError, KeyError, TypeError, OSError, AttributeError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ModelError(
                f"cannot load the tokenizer of '{self.path}' ({type(err).__name__}: {first})",
                fix="the folder needs a readable tokenizer.json or tokenizer files of its model (re-download them)",
            ) from None


def _no_duplicate_keys(pairs: list) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"'{k}' is listed twice")
        out[k] = v
    return out


def read_weight_map(path: Path) -> dict[str, str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(), object_pairs_hook=_no_duplicate_keys)["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError(f"weight_map is a {type(weight_map).__name__}, not a mapping")
        except (ValueError, KeyError, TypeError) as err:
            raise ModelError(f"'{index}' is not a valid safetensors index ({err})") from None
        for shard in set(weight_map.values()):
            inside_model(path, shard, f"'{index}'")
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = {}
    if not shards:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelError(
                f"'{path}' has only pickle weights ({', '.join(pickles)}); fp8ptq never loads pickle files",
                fix="convert them to safetensors first (e.g. with transformers: "
                "from_pretrained(...).save_pretrained(dir, safe_serialization=True) in a trusted environment)",
            )
        raise ModelError(f"'{path}' contains no *.safetensors weights", fix="pass a Hugging Face model directory")
    found = {}
    for shard in shards:
        f = inside_model(path, shard, "the model folder")  # a *.safetensors symlink pointing elsewhere
        if not f.is_file():
            raise ModelError(f"shard '{f}' named in the index is missing")
        try:
            with safe_open(str(f), framework="pt") as h:
                names = list(h.keys())
        except PermissionError:
            raise ModelError(
                f"cannot read '{f}' (permission denied)",
                fix="make it readable by this user (chmod / chown) or copy the model",
            ) from None
        except (SafetensorError, OSError, ValueError) as err:
            # safetensors checks the header and that the data covers the file exactly (truncation)
            raise ModelError(
                f"'{f}' is not a readable safetensors file, truncated or corrupt ({err})",
                fix="re-download or re-convert it",
            ) from None
        for n in names:
            if n in found:  # which copy would win depends on the reader: vLLM's and transformers' differ
                raise ModelError(
                    f"tensor '{n}' is stored twice, in '{found[n]}' and in '{shard}'",
                    fix="keep one copy (repair or re-download the model)",
                )
            found[n] = shard
    for name, shard in weight_map.items():  # what the index promises, each in the shard it names
        if found.get(name) != shard:
            raise ModelError(
                f"'{path / 'model.safetensors.index.json'}' places tensor '{name}' in '{shard}', which does not "
                + ("hold it" if name not in found else f"hold it ('{found[name]}' does)"),
                fix="repair the index (or re-download the model)",
            )
    return weight_map or found


def check_finite(name: str, t: torch.Tensor) -> torch.Tensor:
    """t, or a NonFiniteError naming the tensor when it holds NaN or inf (a broken checkpoint must not
    become a checkpoint whose scales are NaN)."""
    if not t.is_floating_point():
        return t
    if t.dtype == torch.float8_e4m3fn:  # no isfinite kernel for FP8; its only non-finite code is NaN, S.1111.111
        broken = (t.view(torch.uint8) & 0x7F) == 0x7F
    else:
        # min and max propagate NaN and hold any inf: one reduction, 5x faster than isfinite on bf16
        if t.numel() == 0 or all(math.isfinite(float(v)) for v in torch.aminmax(t)):
            return t
        broken = ~torch.isfinite(t)
    if bool(broken.any()):
        bad = int(broken.sum())
        raise NonFiniteError(
            f"tensor '{name}' has {bad} non-finite values (NaN or inf) of {t.numel()}",
            fix="repair or re-download the model; fp8ptq cannot quantize NaN/inf weights",
        )
    return t


def open_hf_dir(path: Path, label: str | None = None) -> ModelSource:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise ModelError(
            f"'{path}' has no config.json", fix="pass a Hugging Face model directory, a .gguf file or an alias"
        )
    weight_map = read_weight_map(path)
    side_files(path)  # config, tokenizer, templates: inside the folder, regular, bounded (models/folder.py)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ModelError(f"cannot read '{path / 'config.json'}' ({type(err).__name__}: {err})") from None
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    if qc is not None and not isinstance(qc, dict):
        raise ModelError(
            f"'{path / 'config.json'}': quantization_config is a {type(qc).__name__}, not a mapping",
            fix="fix config.json (a quantization_config is a JSON object)",
        )
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 - transformers' strict config classes raise their own types
        if not isinstance(err, (ValueError, KeyError, OSError, TypeError)) and "Validation" not in type(err).__name__:
            raise
        raise ModelError(f"cannot read '{path / 'config.json'}': {err}") from None
    arch = arch_for(config)  # a typed error for an unsupported model_type, before any work
    check_architectures(config, path)
    check_sizes(config, weight_map, path)
    # both from the names as stored: a view's module name is no stored name to rename
    renames = arch.renames(list(weight_map))
    views = arch.source_views(list(weight_map), config) if arch.source_views is not None else {}
    stored_files = {}
    if views:
        stored_files = {s: weight_map[s] for v in views.values() for s in v.sources}
        weight_map = {n: s for n, s in weight_map.items() if n not in stored_files} | {
            n: weight_map[v.sources[0]] for n, v in views.items()
        }
    if renames:
        back = {stored: name for name, stored in renames.items() if not name.endswith(".")}  # not the prefixes
        weight_map = {back.get(n, n): s for n, s in weight_map.items()}
    return ModelSource(
        path=path,
        label=label or str(path),
        weight_map=weight_map,
        config=config,
        views=views,
        stored_files=stored_files,
        renames=renames,
    )


def resolve_model(spec: str, revision: str | None = None) -> ModelSource:
    """MODEL argument -> ModelSource: a local directory, a .gguf file, an alias (GGUF files and aliases
    are converted once into the cache) or a Hugging Face hub id (resolve_hub)."""
    if spec in ALIASES:
        gguf = alias_gguf(spec)
        return open_hf_dir(cached_gguf(gguf, gguf_cache_dir(gguf, spec)), label=spec)
    path = Path(spec).expanduser()
    if not path.exists() and HUB_ID.fullmatch(spec) and not spec.startswith("."):
        return open_hf_dir(resolve_hub(spec, revision), label=spec + (f"@{revision}" if revision else ""))
    if not path.exists():
        raise ModelError(
            f"model '{spec}' not found",
            fix="pass an existing directory, a .gguf file, a hub id (org/name) or one of the aliases: "
            + ", ".join(ALIASES),
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return open_hf_dir(cached_gguf(path, gguf_cache_dir(path, path.stem)), label=str(path))
        if path.suffix in PICKLE_SUFFIXES:
            raise ModelError(
                f"'{path}' is a pickle file; fp8ptq never loads pickle files", fix="convert it to safetensors first"
            )
        raise ModelError(f"'{path}' is a file but not .gguf", fix="pass a model directory or a .gguf file")
    return open_hf_dir(path, label=spec)
