"""Offline rotations (QuaRot, Ashkboos et al. 2024; SpinQuant's R1 and R2, Liu et al. 2024), folded
into the weights: the result is a plain float model of the same architecture that any engine loads.

R1 rotates the residual stream by an orthogonal Q (hidden x hidden): every vector written to it is
multiplied by Q, every Linear reading it by Q^T. An RMSNorm commutes with Q only without its weight
(rms(xQ) = rms(x)), so each norm's weight is first folded into the Linears it feeds and set to ones:

    embedding        E'   = E Q
    norm -> Linear   W'   = W diag(w_norm) Q         (q/k/v, gate/up; the LM head with the final norm)
    block output     W'   = Q^T W,  b' = Q^T b        (o_proj, down_proj: they write the residual)

R2 rotates each attention head's values by an orthogonal H (head_dim x head_dim): v_proj's rows of a
KV head become H^T W_v,h, o_proj's columns of every query head W_o,h H (softmax(QK^T) V H H^T = ...).
Q and H are randomised Hadamard matrices (compressed-tensors' construction: random signs times a
Hadamard of order 2^k * m from its table of known matrices), seeded, computed in float64; a width no
such matrix exists for gets a seeded random orthogonal matrix (QR of a Gaussian), reported.

Spreading activation outliers across channels this way makes per-tensor activation scales and FP8
grids fit better (QuaRot). A tied LM head is untied: the head becomes W_e diag(w_final) Q while the
embedding becomes W_e Q (config.json's tie_word_embeddings is set to false). The math is float64;
`dtype=torch.float32` stores the result without rounding it (exact up to fp32 summation order, what
the tests check); quantize runs store it in the source's dtype (bf16: a relative rounding of at most
2^-9 per weight, far below FP8's 2^-4, included in every measured number), so the export keeps the
source's size and dtype.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp8ptq.errors import RecipeError
from fp8ptq.io import atomic_output_dir, write_json_atomic
from fp8ptq.models.arch import Arch
from fp8ptq.models.folder import cache_root
from fp8ptq.models.loader import ModelSource, check_finite, open_hf_dir
from fp8ptq.models.skeleton import build_skeleton

ROTATION_VERSION = 1  # bump when the rotated bytes change (cache key)


def orthogonal(n: int, seed: int) -> tuple[torch.Tensor, str]:
    """(an n x n orthogonal float64 matrix, its kind): a randomised Hadamard / sqrt(n) where
    compressed-tensors can build one, else a random orthogonal matrix. Deterministic in `seed`."""
    from compressed_tensors.transform.utils.hadamard import random_hadamard_matrix

    gen = torch.Generator().manual_seed(seed)
    try:
        h = random_hadamard_matrix(n, torch.float64, gen=gen)
        return h / n**0.5, "hadamard"
    except ValueError:  # no known Hadamard matrix of order n / 2^k
        q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r)), "random-orthogonal"


@dataclass(frozen=True)
class Layout:
    """What R1/R2 touch in a decoder layer (names relative to the layer), read from the adapter."""

    norms: dict[str, tuple[str, ...]]  # norm -> the Linears it feeds
    writers: tuple[str, ...]  # Linears whose output is added to the residual
    value: str | None  # R2: the value projection ...
    out: str | None  # ... and the output projection (None: R2 not applied)


def layout(arch: Arch, config) -> Layout:
    """The layout of `arch`'s layers, or a RecipeError saying why this family cannot be rotated exactly."""

    def refuse(why: str):
        raise RecipeError(
            f"transforms: [rotate] is not supported for the {arch.name} family: {why}",
            fix="drop 'rotate' from the recipe's transforms for this model",
        )

    if arch.expert_lists:
        refuse("the MLP norm also feeds the MoE router (not rotated yet)")
    if arch.norm_offset:
        refuse(f"its RMSNorm multiplies by ({arch.norm_offset:g} + w), not w")
    if any(b.post_norm for b in arch.blocks):
        refuse("a norm after a block's output (post-norm) does not commute with a rotation of the residual")
    if any(b.final is None for b in arch.blocks):
        refuse("a block's output is not produced by one Linear")
    norms = {g.norm: g.linears for g in arch.smooth}
    if sorted(norms) != sorted(b.norm for b in arch.blocks):
        refuse("the adapter does not say which Linears every block's norm feeds")
    layer = arch.decoder_layers(build_skeleton(config))[0]
    modules = dict(layer.named_modules())
    linears = {n for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    writers = tuple(b.final for b in arch.blocks)
    known = {n for ls in norms.values() for n in ls} | set(writers)
    if linears != known:
        refuse(f"Linears the adapter does not place: {', '.join(sorted(linears ^ known))}")
    for norm in norms:
        m = modules[norm]
        if "RMSNorm" not in type(m).__name__ or getattr(m, "bias", None) is not None:
            refuse(f"'{norm}' is a {type(m).__name__}, not a bias-free RMSNorm")
    value, out = arch.head_pair or (None, None)
    return Layout(norms=norms, writers=writers, value=value, out=out)


def _head_dims(config) -> tuple[int, int, int]:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def _rotate_layer(tensors: dict, lay: Layout, q: torch.Tensor, h: torch.Tensor | None, config) -> dict:
    """One decoder layer's tensors (names relative to the layer, float64) -> rotated (float32)."""
    out = dict(tensors)
    for norm, linears in lay.norms.items():
        w = tensors[f"{norm}.weight"]
        for lin in linears:
            out[f"{lin}.weight"] = (tensors[f"{lin}.weight"] * w) @ q
        out[f"{norm}.weight"] = torch.ones_like(w)
    for lin in lay.writers:
        out[f"{lin}.weight"] = q.T @ tensors[f"{lin}.weight"]
        if f"{lin}.bias" in tensors:
            out[f"{lin}.bias"] = q.T @ tensors[f"{lin}.bias"]
    if h is not None:
        heads, kv_heads, d = _head_dims(config)
        v = out[f"{lay.value}.weight"]
        out[f"{lay.value}.weight"] = (h.T @ v.reshape(kv_heads, d, -1)).reshape(v.shape)
        if f"{lay.value}.bias" in out:
            b = out[f"{lay.value}.bias"]
            out[f"{lay.value}.bias"] = (h.T @ b.reshape(kv_heads, d, 1)).reshape(b.shape)
        o = out[f"{lay.out}.weight"]
        out[f"{lay.out}.weight"] = (o.reshape(-1, heads, d) @ h).reshape(o.shape)
    return out


@dataclass(frozen=True)
class RotationReport:
    """What `rotate_model` did (recorded in the rotated directory's rotation.json)."""

    seed: int
    residual: str  # kind of Q (hadamard | random-orthogonal), hidden_size wide
    heads: str | None  # kind of H, head_dim wide; None: R2 not applied (the adapter names no v/o pair)
    untied: bool  # the LM head was tied to the embedding and is now stored on its own
    tensors: int


def rotate_model(src: ModelSource, out: Path, seed: int, dtype: torch.dtype | None = None) -> RotationReport:
    """Write the rotated float model of `src` into `out` (atomically): one file per decoder layer (memory:
    one layer), config with tie_word_embeddings false, the other files copied. dtype: of every stored
    tensor (None: each tensor's source dtype; the untied head: the embedding's)."""
    arch, config = src.arch, src.config
    lay = layout(arch, config)
    q, q_kind = orthogonal(config.hidden_size, seed)
    h, h_kind = orthogonal(_head_dims(config)[2], seed + 1) if lay.value else (None, None)
    model = build_skeleton(config)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head) + ".weight"
    final_norm = arch.final_norm + ".weight"
    embed = f"{arch.embed}.weight"
    untied = not src.has(head_name)
    weight_map, count = {}, 0

    def get(name: str) -> torch.Tensor:
        return check_finite(name, src.tensor(name)).double()

    def stored(tensors: dict, like: dict) -> dict:
        return {k: v.to(dtype or src.tensor_dtype(like.get(k, k))) for k, v in tensors.items()}

    with atomic_output_dir(out, overwrite=True) as tmp:

        def save(tensors: dict, file: str) -> None:
            nonlocal count
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            count += len(tensors)
            src.close()

        n_layers = config.num_hidden_layers
        for i in range(n_layers):
            prefix = arch.layer_prefix(i)
            names = [n for n in src.weight_map if n.startswith(prefix)]
            rotated = _rotate_layer({n[len(prefix) :]: get(n) for n in names}, lay, q, h, config)
            file = f"model-{i + 1:05d}-of-{n_layers + 1:05d}.safetensors"
            save(stored({prefix + k: v for k, v in rotated.items()}, {}), file)
        rest = {n: src.tensor(n) for n in src.weight_map if not arch.is_layer_tensor(n)}
        w_final = get(final_norm)
        rest[head_name] = (get(head_name if not untied else embed) * w_final) @ q
        rest[embed] = get(embed) @ q
        rest[final_norm] = torch.ones_like(w_final)
        save(
            stored(rest, {head_name: head_name if not untied else embed}),
            f"model-{n_layers + 1:05d}-of-{n_layers + 1:05d}.safetensors",
        )
        total = sum((tmp / f).stat().st_size for f in set(weight_map.values()))
        write_json_atomic(
            tmp / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
        )
        cfg = json.loads((src.path / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        write_json_atomic(tmp / "config.json", cfg)
        for f in src.path.iterdir():  # tokenizer, generation config, chat template ...
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", INDEX):
                shutil.copy2(f, tmp / f.name)
        report = RotationReport(seed=seed, residual=q_kind, heads=h_kind, untied=untied, tensors=count)
        write_json_atomic(tmp / "rotation.json", {"version": ROTATION_VERSION, **report.__dict__})
    return report


INDEX = "model.safetensors.index.json"


def rotated_source(src: ModelSource, seed: int) -> tuple[ModelSource, RotationReport]:
    """The rotated float model of `src`, written once into fp8ptq's cache (keyed by the source's files
    and the seed) and opened like any model; the label stays the source's."""
    layout(src.arch, src.config)  # refuse before any work
    key = hashlib.sha1(str(ROTATION_VERSION).encode())
    key.update(f"{src.path.resolve()}:{seed}".encode())
    for f in sorted(src.path.iterdir()):
        if f.is_file():
            st = f.stat()
            key.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    out = cache_root() / "rotated" / f"{src.path.name}-{key.hexdigest()[:12]}"
    if not (out / "rotation.json").is_file():
        rotate_model(src, out, seed)
    saved = json.loads((out / "rotation.json").read_text())
    saved.pop("version")
    return open_hf_dir(out, label=src.label), RotationReport(**saved)
