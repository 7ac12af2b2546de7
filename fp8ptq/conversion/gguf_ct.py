"""GGUF -> compressed-tensors, carrying Q4_0 / Q8_0 codes and scales unchanged (docs/formats.md).

Per Linear of a decoder layer, in vLLM's fused groups (q/k/v, gate/up share one scheme):
  exact         every shard Q4_0, Q5_0 or Q8_0: INT4 (Q4_0 only) / INT8 symmetric group-32 `pack-quantized`
                (W4A16 / W8A16) with weight_scale = the block's fp16 d (as fp32) and the same codes; a group
                mixing them is carried as INT8 (Q4_0's codes [-8, 7] and Q5_0's [-16, 15] are INT8 codes
                too). Checked: the compressed-tensors decompression equals gguf's dequantization bit for
                bit, or the conversion fails.
  carried       no --recipe, and every shard of the group a K-quant (Q4_K, Q5_K, Q6_K) or one of the exact
                types: INT8 symmetric group 32 (W8A16), the K-quant shards re-rounded onto it
                (ops/kquant.int8_grid: at most half an INT8 step, ~0.5% relative on random weights; their
                sub-block offsets and 16-wide scales have no exact compressed-tensors form vLLM serves);
                error against gguf's dequantization recorded per tensor.
  requantized   another GGML quant type (Q4_1, K-quants, IQ...) and a data-free `--recipe`: gguf's
                dequantization re-quantized RTN with the recipe's weights (relative error reported);
  dequantized   another quant type and no recipe (or a non-Linear tensor such as a Q8_0 embedding): gguf's
                dequantization in `dtype` (the cast's max abs error reported, 0 for float32);
  kept          F32 / F16 / BF16 tensors, in their own dtype.
One decoder layer is in memory at a time; each becomes its own safetensors file, joined into one
`model.safetensors` at the end when the checkpoint is under 5 GB (export/merge.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import compressed_tensors
import torch
from compressed_tensors.quantization import QuantizationConfig
from safetensors.torch import save_file

from fp8ptq.errors import RecipeError
from fp8ptq.export.compressed_tensors import MIXED, compress_linear, ct_scheme, decompress_linear
from fp8ptq.export.merge import merge
from fp8ptq.export.writer import SINGLE_SHARD, SINGLE_SHARD_BYTES
from fp8ptq.io import write_json_atomic
from fp8ptq.models.gguf import EXACT_TYPES, FLOAT_TYPES, K_TYPES, GgufModel, GgufTensor
from fp8ptq.models.loader import check_finite
from fp8ptq.ops.ggml import BLOCK, dequantize_groups
from fp8ptq.quantization.plan import plan_layer
from fp8ptq.quantization.schemes import LinearScheme
from fp8ptq.quantization.weights import export_format, quantize_group
from fp8ptq.recipe import QuantArgs, Recipe

REPORT = "conversion.json"


def exact_args(bits: int) -> QuantArgs:
    """The compressed-tensors grid a GGUF Q4_0 (bits 4) or Q8_0 (bits 8) tensor is: symmetric INT, group 32."""
    return QuantArgs(num_bits=bits, type="int", strategy="group", group_size=BLOCK, symmetric=True)


@dataclass(frozen=True)
class Decision:
    action: str  # exact | carried | requantized | dequantized | kept
    scheme: LinearScheme | None = None
    why: str = ""


def _decide_layer(g: GgufModel, index: int, types: dict[str, str], recipe: Recipe | None) -> dict[str, Decision]:
    """Module name -> decision for the Linears of decoder layer `index`, one fused group at a time."""
    layer = g.arch.decoder_layers(g.skeleton)[index]
    prefix = g.arch.layer_prefix(index)
    targeted = set()
    if recipe is not None:
        targeted = set(plan_layer(layer, prefix, recipe.scheme.targets, recipe.scheme.ignore, g.arch).modules)
    out = {}
    for group in plan_layer(layer, prefix, ["Linear"], [], g.arch).groups:
        names = [prefix + n for n in group]
        kinds = [types.get(n + ".weight") for n in names]
        if all(k in EXACT_TYPES for k in kinds):
            bits = max(EXACT_TYPES[k] for k in kinds)
            why = "" if len(set(kinds)) == 1 else f"fused shards {kinds}: Q4_0 codes carried as INT8"
            scheme = LinearScheme(exact_args(bits), None)
            out.update({n: Decision("exact", scheme, why) for n in names})
            continue
        if recipe is None and all(k in EXACT_TYPES or k in K_TYPES for k in kinds):
            scheme = LinearScheme(exact_args(8), None)
            for n, k in zip(names, kinds):
                exact = k in EXACT_TYPES
                why = f"{k} codes in a group with {sorted(set(kinds) - {k})}: INT8" if exact else f"{k} onto INT8 g32"
                out[n] = Decision(
                    "exact" if exact else "carried", scheme, why if len(set(kinds)) > 1 or not exact else ""
                )
            continue
        mixed = "" if len(set(kinds)) == 1 else f"fused with shards of types {kinds}"
        quantized = any(k not in FLOAT_TYPES for k in kinds)
        if quantized and recipe is not None and all(n in targeted for n in group):
            scheme = recipe.linear_scheme()
            out.update({n: Decision("requantized", scheme, mixed) for n in names})
        else:
            why = mixed or ("no --recipe" if recipe is None else "not targeted by the recipe")
            out.update(
                {
                    n: Decision("kept" if types.get(n + ".weight") in FLOAT_TYPES else "dequantized", why=why)
                    for n in names
                }
            )
    return out


def check_recipe(recipe: Recipe | None) -> None:
    if recipe is not None and recipe.needs_data:
        raise RecipeError(
            f"recipe '{recipe.name}' needs calibration data, which `convert` does not run",
            fix=f"use a data-free recipe (RTN weights, dynamic or no activations), or run "
            f"`fp8ptq quantize MODEL.gguf --recipe {recipe.name}` on the GGUF",
        )


def _exact(g: GgufModel, t: GgufTensor, scheme: LinearScheme, carried: bool = False) -> tuple[dict, dict]:
    codes, scale = g.codes(t)
    check_finite(f"{t.name} (its {t.ggml_type} block scales)", scale)
    weight = dequantize_groups(codes, scale)
    packed = compress_linear(weight, {"weight_scale": scale}, scheme)
    back = decompress_linear(packed, ct_scheme(scheme, ["Linear"]), export_format(scheme.weights, None))
    if not torch.equal(back, weight):  # an internal invariant: compressed-tensors keeps these codes
        raise AssertionError(f"{t.name}: compressed-tensors does not reproduce the carried codes")
    reference = g.dequantized(t)
    if not carried:
        if not torch.equal(back, reference):  # the claim: the GGUF's own values, bit for bit
            raise AssertionError(f"{t.name}: compressed-tensors does not reproduce the GGUF values")
        return packed, {"bits": scheme.weights.num_bits, "max_abs_err": 0.0}
    err = back - reference
    rel = float(err.norm() / reference.norm().clamp_min(1e-30))
    return packed, {"bits": scheme.weights.num_bits, "max_abs_err": float(err.abs().max()), "weight_rel_err": rel}


def _requantized(g: GgufModel, tensors: list[GgufTensor], scheme: LinearScheme, recipe: Recipe) -> dict:
    weights = {t.name: check_finite(t.name, g.dequantized(t)) for t in tensors}
    out = {}
    for name, q in quantize_group(weights, scheme.weights, recipe.calibration, None).items():
        out[name] = (compress_linear(q.fake, q.params, scheme), {"scheme": scheme.weights.describe(), **q.report})
    return out


def _float(g: GgufModel, t: GgufTensor, dtype: torch.dtype) -> tuple[torch.Tensor, dict]:
    w = g.dequantized(t)
    if t.ggml_type in FLOAT_TYPES:
        return w.to(FLOAT_TYPES[t.ggml_type]), {}
    cast = w.to(dtype)
    return cast, {"dtype": str(dtype).removeprefix("torch."), "max_abs_err": float((cast.float() - w).abs().max())}


def _convert_tensors(g: GgufModel, tensors: list[GgufTensor], decisions, dtype, recipe):
    """Checkpoint tensors and report records of one layer's (or the non-layer) GGUF tensors."""
    out, records, pending = {}, [], []
    for t in tensors:
        module = t.name.removesuffix(".weight")
        d = decisions.get(module) if t.name.endswith(".weight") else None
        if d is not None and d.action in ("exact", "carried"):
            packed, rec = _exact(g, t, d.scheme, carried=d.action == "carried")
            out.update({f"{module}.{k}": v for k, v in packed.items()})
        elif d is not None and d.action == "requantized":
            pending.append((t, d.scheme))
            continue
        else:
            out[t.name], rec = _float(g, t, dtype)
            d = Decision("kept" if t.ggml_type in FLOAT_TYPES else "dequantized", why=d.why if d else "")
        records.append({"tensor": t.name, "gguf_type": t.ggml_type, "action": d.action, **rec, "why": d.why})
    for fused in _fused_groups(g, [t for t, _ in pending]):  # a layer's re-quantized Linears (one scheme)
        for name, (packed, rec) in _requantized(g, fused, pending[0][1], recipe).items():
            module = name.removesuffix(".weight")
            out.update({f"{module}.{k}": v for k, v in packed.items()})
            t = next(x for x in fused if x.name == name)
            records.append({"tensor": name, "gguf_type": t.ggml_type, "action": "requantized", **rec})
    for name, tensor in out.items():
        check_finite(name, tensor)
    return out, records


def _fused_groups(g: GgufModel, tensors: list[GgufTensor]) -> list[list[GgufTensor]]:
    """Split a layer's tensors into vLLM's fused groups (shards of one GEMM share per-tensor scales)."""
    groups: dict[str, list[GgufTensor]] = {}
    for t in tensors:
        parent, _, leaf = t.name.removesuffix(".weight").rpartition(".")
        fused = next((f for f, shards in g.arch.fused.items() if leaf in shards), leaf)
        groups.setdefault(f"{parent}.{fused}", []).append(t)
    return list(groups.values())


def _key(s: LinearScheme) -> str:
    acts = s.input_activations
    return json.dumps([s.weights.model_dump(), None if acts is None else acts.model_dump()], default=str)


def quantization_config(schemes: dict[str, tuple[LinearScheme, list[str]]]) -> dict | None:
    """compressed-tensors' config: one group per scheme, targeting its modules by exact name."""
    if not schemes:
        return None
    formats = {export_format(s.weights, s.input_activations) for s, _ in schemes.values()}
    mixed = len(formats) > 1
    cfg = QuantizationConfig(
        config_groups={
            f"group_{i}": ct_scheme(s, sorted(names), with_format=mixed)
            for i, (s, names) in enumerate(schemes.values())
        },
        format=MIXED if mixed else formats.pop(),
        quantization_status="compressed",
        ignore=[],
    )
    return {
        "quant_method": "compressed-tensors",
        "version": compressed_tensors.__version__,
        **json.loads(cfg.model_dump_json(exclude=["quant_method"])),
    }


def gguf_to_compressed_tensors(g: GgufModel, tmp: Path, dtype: torch.dtype, recipe: Recipe | None) -> dict:
    """Write the checkpoint into `tmp` (an atomic output dir); returns the conversion report."""
    check_recipe(recipe)
    # a tensor whose values transformers' processor changes cannot carry its codes: decided as a non-exact type
    types = {t.name: t.ggml_type if g.carries_codes(t) else f"{t.ggml_type} (processed)" for t in g.tensors}
    n_layers = g.config.num_hidden_layers
    by_layer: dict[int, list[GgufTensor]] = {i: [] for i in range(n_layers)}
    rest = []
    for t in g.tensors:
        if g.arch.is_layer_tensor(t.name):
            by_layer[int(t.name[len(g.arch.layers) + 1 :].split(".")[0])].append(t)
        else:
            rest.append(t)
    chunks = [by_layer[i] for i in range(n_layers)] + ([rest] if rest else [])
    records, weight_map, schemes, total = [], {}, {}, 0
    for i, tensors in enumerate(chunks):
        decisions = _decide_layer(g, i, types, recipe) if i < n_layers else {}
        for module, d in decisions.items():
            if d.scheme is not None:
                schemes.setdefault(_key(d.scheme), (d.scheme, []))[1].append(module)
        out, recs = _convert_tensors(g, tensors, decisions, dtype, recipe)
        records += recs
        shard = f"model-{i + 1:05d}-of-{len(chunks):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in out.items()}, str(tmp / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in out})
        total += (tmp / shard).stat().st_size
        del out
    if total < SINGLE_SHARD_BYTES:  # one file, as save_pretrained writes a model of this size
        shards = sorted(set(weight_map.values()))
        merge([tmp / f for f in shards], tmp / SINGLE_SHARD, metadata={"format": "pt"})
        for f in shards:
            (tmp / f).unlink()
        weight_map = dict.fromkeys(weight_map, SINGLE_SHARD)
        total = (tmp / SINGLE_SHARD).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json_atomic(tmp / "model.safetensors.index.json", index, trailing_newline=True)
    config = g.config
    config.dtype = dtype
    config.save_pretrained(str(tmp))
    qc = quantization_config(schemes)
    if qc is not None:
        data = json.loads((tmp / "config.json").read_text())
        data["quantization_config"] = qc
        write_json_atomic(tmp / "config.json", data, trailing_newline=True)
    g.tokenizer().save_pretrained(str(tmp))
    report = {
        "source": str(g.path),
        "to": "compressed-tensors",
        "dropped": g.dropped,
        "summary": summarize(records),
        "tensors": records,
    }
    write_json_atomic(tmp / REPORT, report, trailing_newline=True)
    return report


def summarize(records: list[dict]) -> dict:
    """Counts per action, bits of the exact ones, worst errors of the lossy ones."""
    actions = ("exact", "carried", "requantized", "dequantized", "kept")
    s: dict = {a: sum(r["action"] == a for r in records) for a in actions}
    for bits in (4, 8):
        s[f"exact_int{bits}"] = sum(r.get("bits") == bits and r["action"] == "exact" for r in records)
    for a in ("carried", "requantized"):
        s[f"worst_{a}_rel_err"] = max((r["weight_rel_err"] for r in records if r["action"] == a), default=0.0)
    deq = [r["max_abs_err"] for r in records if r["action"] == "dequantized"]
    s["worst_dequantized_abs_err"] = max(deq, default=0.0)
    return s


def check(cfg, fmt: str) -> tuple[GgufModel, Recipe | None]:
    """The recipe (data-free) and the GGUF file opened and checked, before any output exists."""
    from fp8ptq.models.gguf import open_gguf
    from fp8ptq.recipe import load_recipe

    recipe = None if cfg.recipe is None else load_recipe(cfg.recipe)
    check_recipe(recipe)
    return open_gguf(cfg.source), recipe


def write(cfg, fmt: str, checked: tuple[GgufModel, Recipe | None], tmp: Path) -> dict:
    model, recipe = checked
    return gguf_to_compressed_tensors(model, tmp, getattr(torch, cfg.dtype), recipe)


def describe(report: dict) -> str:
    s = report["summary"]
    parts = [f"{s['exact']} exact (int4 g32: {s['exact_int4']}, int8 g32: {s['exact_int8']})"]
    if s.get("carried"):
        parts.append(
            f"{s['carried']} K-quant carried as int8 g32 (worst weight rel err {s['worst_carried_rel_err']:.3g})"
        )
    if s["requantized"]:
        parts.append(f"{s['requantized']} re-quantized (worst weight rel err {s['worst_requantized_rel_err']:.3g})")
    if s["dequantized"]:
        parts.append(f"{s['dequantized']} dequantized (worst cast abs err {s['worst_dequantized_abs_err']:.3g})")
    parts.append(f"{s['kept']} kept float")
    return "tensors: " + ", ".join(parts)
