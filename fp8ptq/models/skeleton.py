"""Build a model's module tree without weights (meta device) and fill one submodule at a time."""

from __future__ import annotations

import copy

import torch

from fp8ptq.io import trim_heap
from fp8ptq.models.arch import arch_for
from fp8ptq.models.arch.generic import GenericArch, build_model
from fp8ptq.models.loader import ModelSource, check_finite
from fp8ptq.models.tensors import stored_names


def plain_config(config):
    """A copy of config without quantization_config, so transformers builds plain nn.Linear modules."""
    config = copy.deepcopy(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def build_skeleton(config, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The full causal-LM module tree on the meta device (no memory), with its real rotary embedding,
    each decoder layer reshaped by its adapter's `prepare_layer` (module names = checkpoint names)."""
    from transformers import AutoModelForCausalLM

    config = plain_config(config)
    arch = arch_for(config)
    if arch.eager_attention:  # "sdpa" -> "eager", "fp8ptq_sdpa" -> "fp8ptq_eager" (quantization/numerics.py)
        attn_implementation = attn_implementation.replace("sdpa", "eager")
    if isinstance(arch, GenericArch):  # parameters on meta, buffers (rotary, embedding scale) computed
        model = build_model(config, attn_implementation=attn_implementation)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, attn_implementation=attn_implementation, trust_remote_code=False
            )
        rotary = model.get_submodule(arch.rotary)
        model.set_submodule(arch.rotary, type(rotary)(config=model.config))  # real inv_freq buffer on the CPU
        embed = model.get_submodule(arch.embed)
        if arch.embed_scale is not None and "embed_scale" in embed._buffers:  # Gemma's scaled embedding
            embed.embed_scale = torch.tensor(arch.embed_scale(model.config))
    if arch.prepare_layer is not None:
        with torch.device("meta"):  # new modules (one Linear per expert) hold no memory until materialized
            for layer in arch.decoder_layers(model):
                arch.prepare_layer(layer, model.config)
    return model


def check_agrees(src: ModelSource, tokenizer=None) -> None:
    """ModelError unless an unquantized source holds what its own config builds: at least one decoder
    layer, every parameter and persistent buffer of the module tree (the LM head, or a tied embedding),
    each in the shape the config gives it, and an embedding with a row for every token of its tokenizer.
    Run before any work: transformers would initialise a missing layer at random, and a wrong shape would
    surface as a traceback deep in calibration. (Quantized checkpoints store other names and shapes;
    their own readers check them.)"""
    from fp8ptq.errors import ModelError

    config = src.config
    where = f"'{src.path}'"
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if not isinstance(layers, int) or layers < 1:
        raise ModelError(f"{where}: config.json says num_hidden_layers {layers!r}", fix="repair config.json")
    if getattr(config, "quantization_config", None) is not None:
        return
    model = build_skeleton(config)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name not in stored_names(model):
            continue
        stored = source_name(src, name)
        if not src.has(stored):
            raise ModelError(
                f"{where} lacks tensor '{stored}' (shape {list(t.shape)}), which its config builds",
                fix="use a complete checkpoint: the config and the weights must describe the same model",
            )
        shape = src.tensor_shape(stored)
        if tuple(shape) != tuple(t.shape):
            raise ModelError(
                f"{where}: tensor '{stored}' is {list(shape)} but its config builds {list(t.shape)}",
                fix="use a checkpoint whose config.json matches its weights",
            )
    if tokenizer is not None:
        rows = src.tensor_shape(f"{src.arch.embed}.weight")[0]
        if len(tokenizer) > rows:
            raise ModelError(
                f"{where}: the tokenizer has {len(tokenizer)} tokens but the embedding only {rows} rows",
                fix="use the tokenizer that belongs to these weights",
            )


def source_name(src: ModelSource, name: str) -> str:
    """Tied LM heads are stored only as the embedding."""
    arch = src.arch
    if not src.has(name) and name == "lm_head.weight" and getattr(src.config, "tie_word_embeddings", False):
        return f"{arch.embed}.weight"
    return name


_MAPPED_BYTES = 256 << 20  # source bytes read between closing the shards' memory maps


def stored_sources(module: torch.nn.Module, prefix: str, src: ModelSource) -> dict[str, str]:
    """Module-relative name -> the source's tensor name, for every tensor `materialize` loads (KeyError
    naming the first the source lacks)."""
    names = {n: source_name(src, prefix + n) for n in stored_names(module)}
    for full in names.values():
        if not src.has(full):
            raise KeyError(f"tensor '{full}' missing from {src.path}")
    return names


def materialize(module: torch.nn.Module, prefix: str, src: ModelSource, dtype: torch.dtype, device="cpu") -> None:
    """Load module's parameters and persistent buffers (names under `prefix`) from the source shards."""
    state, mapped = {}, 0
    for name, full in stored_sources(module, prefix, src).items():
        t = src.tensor(full)
        mapped += t.numel() * t.element_size()
        state[name] = check_finite(full, t).to(device=device, dtype=dtype)
        del t
        if mapped > _MAPPED_BYTES:  # pages read through a live mapping stay in RSS: drop them as we go
            src.close()
            mapped = 0
    module.load_state_dict(state, strict=False, assign=True)


def load_float(src: ModelSource, device="cpu", attn_implementation: str = "sdpa") -> torch.nn.Module:
    """The whole model of an unquantized source in fp32 (eval mode), e.g. a reference."""
    model = build_skeleton(src.config, attn_implementation=attn_implementation)
    state = {n: src.tensor(source_name(src, n)).float() for n in stored_names(model)}
    model.load_state_dict(state, strict=False, assign=True)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.to(device).eval()


def release(module: torch.nn.Module) -> None:
    """Drop a module's tensors (back to meta) and return the freed memory to the OS (`io.trim_heap`)."""
    module.to("meta")
    trim_heap()
