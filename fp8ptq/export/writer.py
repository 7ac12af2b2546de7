"""Stream a quantized checkpoint to disk one decoder layer at a time.

Each finished layer becomes its own safetensors file (and a small JSON report) in the run directory,
written to a temp name, fsynced and renamed, so a layer on disk is complete and a resumed run can
trust it. `finish()` writes the remaining (non-layer) tensors and then, for an export under
SINGLE_SHARD_BYTES, joins every file into one `model.safetensors` (export/merge.py, a tensor at a time) as
transformers' save_pretrained writes a model of that size; a larger one keeps a shard per layer, renamed
into HF shard names (`model-0000k-of-0000n.safetensors`). Either way `model.safetensors.index.json` lists
every tensor's shard. Memory: one layer, two
while a writer thread (runs/calibrated.py, runs/data_free.py) writes layer i as layer i+1 is quantized.
Tensors the recipe does not quantize are copied from the source in its dtype; tensors changed by exact
transforms (smoothed norms, flattened MLP weights left unquantized) are written in the source's dtype.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp8ptq.export.compressed_tensors import compress_linear
from fp8ptq.export.merge import merge
from fp8ptq.io import write_atomic, write_json_atomic
from fp8ptq.models.loader import ModelSource, check_finite
from fp8ptq.models.prefetch import PREFETCH_MAX_BYTES
from fp8ptq.models.skeleton import source_name
from fp8ptq.models.tensors import layers_past
from fp8ptq.models.views import PartView
from fp8ptq.quantization.results import LayerResult
from fp8ptq.quantization.schemes import LinearScheme
from fp8ptq.quantization.weights import quantize_group

LAYERS = "layers"
HEAD = "lm_head.weight"  # the skeleton's name of the LM head (every causal-LM class transformers builds)
REST_FILE_BYTES = 1 << 30
SINGLE_SHARD_BYTES = 5 << 30  # transformers' former default max_shard_size: exports below it are one file
SINGLE_SHARD = "model.safetensors"


def _save(tensors: dict[str, torch.Tensor], path: Path) -> int:
    data = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    write_atomic(path, lambda tmp: save_file(data, str(tmp), metadata={"format": "pt"}))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _to_host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host tensor with t's values: from a GPU with pin, an asynchronous copy into pinned memory (valid
    once HostCopy.wait returns), without it a blocking copy; host tensors as they are."""
    t = t.detach()
    return t.to("cpu", non_blocking=pin) if t.is_cuda else t


@dataclass
class HostCopy:
    """The device->host copies of one layer, and the names `write_layer` checks once they landed."""

    check: list[str]
    event: object = None  # torch.cuda.Event recorded after the copies; None: nothing in flight

    @classmethod
    def record(cls, check: list[str]) -> HostCopy:
        event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            event = torch.cuda.Event()
            event.record()
        return cls(check, event)

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class CheckpointWriter:
    def __init__(self, src: ModelSource, run_dir: Path):
        self.src, self.dir = src, Path(run_dir)
        self.head_report: dict | None = None
        (self.dir / LAYERS).mkdir(exist_ok=True)

    def layer_tensors(self, res: LayerResult) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for module, q in res.linears.items():
            for k, t in compress_linear(q.weight, q.params, q.scheme).items():
                out[f"{module}.{k}"] = t.clone()  # own storage: fused shards share scale tensors
        for module, (tensors, _) in res.packed.items():
            out.update({f"{module}.{k}": t for k, t in tensors.items()})
        for name, scale in res.kv_scales.items():
            # [1] per layer, [kv_heads, 1, 1] per head: the shapes compressed-tensors creates
            out[name] = scale.float().reshape(1) if scale.numel() == 1 else scale.float().reshape(-1, 1, 1)
        quantized = {f"{m}.weight" for m in [*res.linears, *res.packed]}
        for name, t in res.float_tensors.items():
            if name not in quantized:
                out[name] = t.to(self.src.tensor_dtype(name) if self.src.has(name) else torch.bfloat16)
        for name in self.src.weight_map:
            if name.startswith(res.prefix) and name not in quantized and name not in out:
                out[name] = self.src.tensor(name)
        return out

    def layer_payload(self, res: LayerResult) -> tuple[Path, dict[str, torch.Tensor], dict, HostCopy]:
        """Everything `write_layer` needs, read from the source and copied to host memory, so the write can
        run in another thread while the device goes on with the next layer. On a GPU the copies are
        asynchronous (pinned, non-blocking, ordered on the current stream): this thread never waits for the
        device here; `write_layer` waits for them (HostCopy) before it checks and serialises."""
        out = self.layer_tensors(res)
        # pinned only up to the layer reader's bound (models/prefetch.py): page-locking a huge MoE layer's
        # codes costs more than the wait it saves
        pin = sum(t.numel() * t.element_size() for t in out.values() if t.is_cuda) <= PREFETCH_MAX_BYTES
        tensors = {k: _to_host(t, pin) for k, t in self.src.stored_tensors(out).items()}
        self.src.close()
        quantized = {m: q.report for m, q in res.linears.items()} | {m: r for m, (_, r) in res.packed.items()}
        # no code path may write a NaN scale or weight. Directly packed FP8 is checked where it is made
        # (runs/data_free.py: a finite scale, and codes clamped below the NaN code): a pass over every code
        # here cost ~10% of a data-free conversion.
        packed = {self.src.stored_name(f"{m}.{k}") for m, (t, _) in res.packed.items() for k in t}
        return (
            self.dir / LAYERS / f"layer-{res.index:05d}.safetensors",
            tensors,
            {"index": res.index, "quantized": quantized, **res.report},
            HostCopy.record([n for n in tensors if n not in packed]),
        )

    def write_layer(self, path: Path, tensors: dict[str, torch.Tensor], report: dict, copy: HostCopy) -> None:
        """Wait for the layer's host copies, check every tensor but direct FP8 packs is finite (the error
        names it), and write the layer (serialised, fsynced, renamed) with its report."""
        copy.wait()
        for name in copy.check:
            check_finite(name, tensors[name])
        report = {**report, "bytes": _save(tensors, path)}
        write_json_atomic(path.with_suffix(".json"), report)

    def reports(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted((self.dir / LAYERS).glob("layer-*.json"))]

    def finish(self, num_layers: int, head: LinearScheme | None = None, cal=None) -> list[str]:
        """Write the non-layer tensors (head: the LM head's scheme, quantized here by round to nearest on
        its grid; cal: the recipe's calibration section), join or rename all files into HF shards, write the
        index. A run stopped after the join (its merged file is complete: written atomically) only
        finishes the index."""
        if (self.dir / SINGLE_SHARD).is_file():
            return self._index([SINGLE_SHARD])
        layer_files = [self.dir / LAYERS / f"layer-{i:05d}.safetensors" for i in range(num_layers)]
        missing = [p.name for p in layer_files if not p.is_file()]
        assert not missing, f"layers not written: {missing[:3]}"
        files = list(layer_files)
        if head is not None:
            files.append(self.dir / LAYERS / "other-head.safetensors")
            _save(self._head_tensors(head, cal), files[-1])
        for j, names in enumerate(self._rest_files(head is not None)):  # embeddings, final norm, MTP layers
            files.append(self.dir / LAYERS / f"other-{j:03d}.safetensors")
            tensors = {n: check_finite(n, self.src.tensor(n)) for n in names}
            _save(self.src.stored_tensors(tensors), files[-1])  # a tower's split q/k/v: fused back as stored
            self.src.close()
        if sum(f.stat().st_size for f in files) < SINGLE_SHARD_BYTES:
            merge(files, self.dir / SINGLE_SHARD, metadata={"format": "pt"})
            for f in files:
                f.unlink()
            return self._index([SINGLE_SHARD])
        names = []
        for i, f in enumerate(files):
            names.append(f"model-{i + 1:05d}-of-{len(files):05d}.safetensors")
            os.replace(f, self.dir / names[-1])
        return self._index(names)

    def _index(self, shards: list[str]) -> list[str]:
        """Write model.safetensors.index.json for the finished shards (read from their headers)."""
        from safetensors import safe_open

        weight_map, total = {}, 0
        for shard in shards:
            with safe_open(str(self.dir / shard), framework="pt") as h:
                weight_map.update({k: shard for k in h.keys()})
            total += (self.dir / shard).stat().st_size
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return shards

    def _head_tensors(self, head: LinearScheme, cal) -> dict[str, torch.Tensor]:
        """The quantized LM head's tensors under the head's stored name. A tied head is read from the
        embedding (which is still written as stored) and written as its own `lm_head`."""
        name = source_name(self.src, HEAD)
        w = check_finite(name, self.src.tensor(name))
        rtn = cal.model_copy(update={"weight_method": "rtn"})  # no Hessian of the head's inputs is gathered
        qw = quantize_group({"lm_head": w}, head.weights, rtn, None, head.input_activations is None)["lm_head"]
        self.head_report = dict(qw.report, source=name, tied=name != HEAD)
        prefix = self.src.stored_name(HEAD).removesuffix(".weight") if self.src.has(HEAD) else "lm_head"
        tensors = {f"{prefix}.{k}": t.clone() for k, t in compress_linear(qw.fake, qw.params, head).items()}
        for k, t in tensors.items():
            check_finite(k, t)
        self.src.close()
        return tensors

    def _rest_files(self, head_written: bool = False) -> list[list[str]]:
        """The non-layer tensors, and those of layers past num_hidden_layers (MTP layers, carried as
        stored: models/tensors.layers_past), in files of at most REST_FILE_BYTES (a larger tensor gets its
        own), so memory holds one file's worth, not a 70B model's embeddings and head together."""
        files: list[list[str]] = []
        size = REST_FILE_BYTES
        extra = tuple(p + "." for p in layers_past(self.src.weight_map, self.src.arch.layers, self.src.text_config))
        rest = (n for n in self.src.weight_map if not self.src.arch.is_layer_tensor(n) or n.startswith(extra))
        # the parts of one stored tensor (PartView) in one file: only all of them write it back
        groups: dict[str, list[str]] = {}
        for n in sorted(n for n in rest if not (head_written and n == HEAD)):
            view = self.src.views.get(n)
            groups.setdefault(view.stored if isinstance(view, PartView) else n, []).append(n)
        for group in groups.values():
            nbytes = sum(self.src.tensor_bytes(n) for n in group)
            if size + nbytes > REST_FILE_BYTES:
                files.append([])
                size = 0
            files[-1].extend(group)
            size += nbytes
        return files

    def cleanup(self) -> None:
        """Remove the per-layer reports (they are in the manifest by now)."""
        for p in (self.dir / LAYERS).glob("*"):
            p.unlink()
        (self.dir / LAYERS).rmdir()


class BackgroundWrites:
    """Layer i serialised and fsynced by one writer thread while layer i+1 is computed. A layer counts as
    done (`on_done(i)`) only once it is on disk; a write's error is raised in the caller's thread, at the
    next `submit` or `settle`. `writer` None: a rank that writes nothing (its layers are done at once)."""

    def __init__(self, writer: CheckpointWriter | None, on_done):
        self.writer, self.on_done = writer, on_done
        self.pending: tuple[int, object] | None = None
        self.pool = None

    def __enter__(self) -> BackgroundWrites:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp8ptq-writer")
        return self

    def submit(self, res: LayerResult) -> None:
        """Start writing `res`, then settle the layer before it."""
        w = self.writer
        write = None if w is None else self.pool.submit(w.write_layer, *w.layer_payload(res))
        self.settle()
        self.pending = (res.index, write)

    def settle(self) -> None:
        """Wait for the layer being written and record it as done."""
        if self.pending is None:
            return
        i, write = self.pending
        self.pending = None
        if write is not None:
            write.result()
        self.on_done(i)

    def __exit__(self, exc_type, *_exc) -> None:
        try:
            if exc_type is None:
                self.settle()
        finally:
            self.pool.shutdown(wait=True)
