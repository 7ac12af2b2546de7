"""The generic adapter (models/arch/generic.py) on model types no adapter registers — a new dense family,
a multimodal checkpoint, an MoE family and a hybrid linear-attention family, checkpoints whose tensors
transformers joins, splits or stacks on load (experts stored fused in 3-D tensors, a fused q/k/v, split
convolutions), tiny random models from transformers' own config classes — and on every registered
family, where it must find what the adapter says."""

import json

import pytest
import torch
from safetensors import safe_open

from fp8ptq.errors import ModelError
from fp8ptq.models.arch import ARCHS, arch_for, registered
from fp8ptq.models.arch.generic import GenericArch, discover
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.models.skeleton import build_skeleton, load_float, materialize, stored_names
from fp8ptq.quantization.plan import plan_layer
from tests.helpers import run_cli

pytestmark = pytest.mark.tiny

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
FAMILIES = {
    "olmo3": {},  # dense, q/k norms over all heads
    "gemma3": {},  # Gemma3ForConditionalGeneration: a SigLIP tower beside the language model
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    "qwen3_next": dict(  # gated DeltaNet + full attention, sparse MLP with a gated shared expert
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        layer_types=("linear_attention", "full_attention"),
    ),
    # experts stored as transformers holds them: `block_sparse_moe.input_linear.weight` [E, 2I, H]
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2),
    # q/k/v stored fused as `attention.query_key_value` (transformers splits it on load)
    "sarvam_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1),
    # the linear attention's q/k/v convolutions stored apart (transformers joins them into `conv1d`)
    "olmo_hybrid": dict(layer_types=("linear_attention", "full_attention")),
    # a shared expert's gate/up stored apart (joined into `gate_up_proj`), experts with a clamped SwiGLU
    "minimax_m3_vl": dict(num_local_experts=8, num_experts_per_tok=2),
}


def _model(tiny_model, model_type):
    return tiny_model(model_type, max_position_embeddings=512, **SIZES, **FAMILIES[model_type])


def _reference(path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            return auto.from_pretrained(str(path), dtype=torch.float32).eval()
        except ValueError:
            continue
    raise AssertionError(path)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_whole_layers_with_captured_inputs_are_the_models_own_forward(model_type, tiny_model):
    path = _model(tiny_model, model_type)
    src = open_hf_dir(path)
    arch = src.arch
    assert isinstance(arch, GenericArch) and model_type not in registered()
    model = load_float(src)
    layers = arch.decoder_layers(model)
    ids = torch.randint(0, src.text_config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    reference = _reference(path)
    with torch.inference_mode():
        hidden = reference(input_ids=ids, output_hidden_states=True).hidden_states
        inputs = arch.layer_inputs(model, ids.shape[1], "cpu")
        x = hidden[0]
        for i, layer in enumerate(layers[:-1]):  # the last hidden state is after the final norm
            x = arch.run_block(layer, arch.blocks[0], x, inputs(i))
            torch.testing.assert_close(x, hidden[i + 1], rtol=1e-4, atol=1e-4)


def test_what_discovery_finds_in_new_families(tiny_model):
    gemma = open_hf_dir(_model(tiny_model, "gemma3")).arch
    assert gemma.layers == "model.language_model.layers" and gemma.towers == (
        "model.vision_tower",
        "model.multi_modal_projector",
    )
    assert gemma.embed_scale(None) == pytest.approx(64**0.5)  # Gemma's scaled embedding, read off the module
    nxt = open_hf_dir(_model(tiny_model, "qwen3_next"))
    arch = nxt.arch
    assert arch.expert_lists == ("mlp.experts",) and "re:.*mlp\\.shared_expert_gate$" in arch.keep_float
    skeleton = build_skeleton(nxt.config)
    layers = arch.decoder_layers(skeleton)
    # the hybrid stack: a KV cache only where a layer attends
    assert [arch.attention_of(layer) for layer in layers] == [None, "self_attn"]
    for i, layer in enumerate(layers):
        plan = plan_layer(layer, arch.layer_prefix(i), ["Linear"], [], arch)
        assert ("mlp.experts.3.gate_proj", "mlp.experts.3.up_proj") in plan.groups
        assert ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj") in plan.groups
        assert ("mlp.gate" not in plan.modules) and ("mlp.shared_expert_gate" not in plan.modules)
    assert ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba") in plan_layer(
        layers[0], arch.layer_prefix(0), ["Linear"], [], arch
    ).groups
    assert ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") in plan_layer(
        layers[1], arch.layer_prefix(1), ["Linear"], [], arch
    ).groups


# gpt-oss (fused, transposed experts with biases) and Mixtral (experts stored as w1/w3/w2) are laid out
# in ways only their adapters know; every other registered family is discovered as its adapter says.
ADAPTER_ONLY = {"gpt_oss", "mixtral"}


@pytest.mark.parametrize("model_type", sorted(set(registered()) - ADAPTER_ONLY))
def test_discovery_finds_what_each_adapter_says(model_type, tiny_model):
    src = open_hf_dir(tiny_model(model_type))
    adapter, generic = ARCHS[model_type], discover(src.config)
    assert (generic.layers, generic.embed) == (adapter.layers, adapter.embed)
    a_model, g_model = build_skeleton(src.config), build_model_generic(src.config, generic)
    assert stored_names(a_model) == stored_names(g_model)  # the tensor names both read and write
    for i, (a_layer, g_layer) in enumerate(zip(adapter.decoder_layers(a_model), generic.decoder_layers(g_model))):
        prefix = adapter.layer_prefix(i)
        a_plan = plan_layer(a_layer, prefix, ["Linear"], [], adapter)
        g_plan = plan_layer(g_layer, prefix, ["Linear"], [], generic)
        assert sorted(a_plan.groups) == sorted(g_plan.groups), (i, a_plan.groups, g_plan.groups)
        assert dict(a_plan.skipped).keys() == dict(g_plan.skipped).keys()  # routers kept float by both
        assert generic.attention_of(g_layer) == adapter.attention
        materialize(g_layer, prefix, src, torch.float32)  # the smoothing maps are traced on the real layer
        smooth = {(g.key, g.norm, g.linears, g.offset) for g in generic.smooth_groups(g_layer, prefix)}
        said = {(g.key, g.norm, g.linears, adapter.norm_offset) for g in adapter.smooth}
        # the adapters leave out the MLP norm of every MoE family's layers (it feeds the router), even of
        # their dense layers; discovery finds it where the layer is dense
        assert said <= smooth and all(g[0] == "gate_up" and not adapter.flatten for g in smooth - said), (smooth, said)
    assert (generic.kv_cache, generic.latent_kv) == (adapter.kv_cache, adapter.latent_kv)


def build_model_generic(config, arch):
    """The generic skeleton of a registered family (build_skeleton picks the adapter by model_type)."""
    from fp8ptq.models.arch.generic import build_model

    model = build_model(config)
    for layer in arch.decoder_layers(model):
        if arch.prepare_layer is not None:
            with torch.device("meta"):
                arch.prepare_layer(layer, model.config)
    return model


def test_a_model_type_transformers_cannot_build_is_refused_with_the_model_free_path():
    with pytest.raises(ModelError) as e:
        arch_for({"model_type": "my_new_arch", "architectures": ["MyNewArchForCausalLM"]})
    assert "my_new_arch" in str(e.value) and "model-free" in e.value.fix


def test_smoothing_maps_are_observed_not_guessed(tiny_model):
    """SmoothQuant needs a norm whose output only the group's Linears read: Gemma 3's pre-norms (with
    their (1 + w)), not OLMo 3's post-norms (nothing reads their output but the residual), not the MLP
    norm of an MoE layer (its router reads it too)."""
    found = {}
    for model_type in ("gemma3", "olmo3", "glm4_moe"):
        src = open_hf_dir(_model(tiny_model, model_type))
        arch, model = src.arch, build_skeleton(src.config)
        for i, layer in enumerate(arch.decoder_layers(model)):
            materialize(layer, arch.layer_prefix(i), src, torch.float32)
            found[model_type, i] = {
                (g.key, g.norm, g.linears, g.offset) for g in arch.smooth_groups(layer, arch.layer_prefix(i))
            }
    qkv = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    assert found["gemma3", 1] == {
        ("qkv", "input_layernorm", qkv, 1.0),
        ("gate_up", "pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), 1.0),
    }
    assert found["olmo3", 0] == found["olmo3", 1] == set()
    assert found["glm4_moe", 0] == {
        ("qkv", "input_layernorm", qkv, 0.0),
        ("gate_up", "post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), 0.0),
    }
    assert found["glm4_moe", 1] == {("qkv", "input_layernorm", qkv, 0.0)}  # layer 1 is sparse


def test_multimodal_checkpoint_keeps_its_tower_and_reloads(tiny_model, tmp_path):
    """fp8-kv8 on Gemma3ForConditionalGeneration: the language model quantized with KV scales, every
    tower tensor written as stored and listed in ignore, the checkpoint's names and class kept."""
    from transformers import AutoModelForImageTextToText

    path = _model(tiny_model, "gemma3")
    processor = {"image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256}  # as the hub's
    (path / "preprocessor_config.json").write_text(json.dumps(processor))
    out = tmp_path / "gemma3-fp8-kv8"
    args = ["quantize", path, "-r", "fp8-kv8", "-o", out, "--num-samples", "4", "--seq-len", "32"]
    rc, output = run_cli(*args, "--eval-samples", "1", "--no-recipe-gates")
    assert rc == 0, output
    assert (out / "preprocessor_config.json").read_text() == json.dumps(processor)  # served as the same model
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert "re:.*vision_tower\\..*" in config["quantization_config"]["ignore"]
    src_names, out_tensors = _tensors(path), _tensors(out)
    tower = [n for n in src_names if n.startswith("vision_tower.")]
    assert tower and all(torch.equal(src_names[n], out_tensors[n]) for n in tower)
    layer0 = "language_model.model.layers.0.self_attn."  # the checkpoint's own (legacy) prefix
    assert {f"{layer0}q_proj.weight_scale", f"{layer0}k_scale"} <= out_tensors.keys()
    model = AutoModelForImageTextToText.from_pretrained(str(out))  # transformers reloads it as stored
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def test_a_discovered_layout_says_so_when_it_refuses_a_recipe(tiny_model, tmp_path):
    """An MLA family no adapter registers caches one latent entry per token under one scale: per-head KV
    scales are refused before any work, and the message names the discovered layout rather than an adapter
    that does not exist."""
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.errors import RecipeError

    model = tiny_model(
        "deepseek_v2", max_position_embeddings=512, **{**SIZES, "num_key_value_heads": 4}, q_lora_rank=64,
        kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64,
    )  # fmt: skip
    with pytest.raises(
        RecipeError, match="deepseek_v2's layout \\(discovered from the model; no fp8ptq adapter\\)"
    ) as e:
        sets = ("scheme.kv_cache.strategy=attn_head",)
        quantize(QuantizeConfig(model=str(model), recipe="fp8-kv8", output=tmp_path / "q", sets=sets))
    assert not (tmp_path / "q").exists()
    assert "caches MLA's latent" in str(e.value) and "strategy: tensor" in str(e.value)  # the way out


# model type -> (a tensor name the source stores and the export keeps, a module name it must not write)
STORED_LAYOUT = {
    "granitemoe": ("model.layers.1.block_sparse_moe.experts.7.up_proj.weight_scale", "gate_up_proj"),
    "sarvam_moe": ("model.layers.0.attention.query_key_value.weight_scale", "self_attn.q_proj"),
    "olmo_hybrid": ("model.layers.0.linear_attn.q_conv1d.weight", "linear_attn.conv1d"),
    "minimax_m3_vl": (
        "language_model.model.layers.0.block_sparse_moe.shared_experts.up_proj.weight_scale",
        "shared_experts.gate_up_proj",
    ),
}


@pytest.mark.parametrize("model_type", sorted(STORED_LAYOUT))
def test_an_export_keeps_the_layout_the_source_stores(model_type, tiny_model, tmp_path):
    """Layers that transformers builds from joined, split or 3-D-stacked checkpoint tensors are calibrated
    as the modules they are, and written back as the source stored them (what the family's engine loader
    reads): every quantized module decompresses, read back through the same views, to exactly what
    calibration simulated, and fp8ptq's lint finds nothing wrong."""
    from fp8ptq.api import InspectConfig, QuantizeConfig, inspect
    from tests.helpers import decompression_mismatches, quantize_recording

    out = tmp_path / "q"
    cfg = QuantizeConfig(
        model=str(_model(tiny_model, model_type)), recipe="fp8-dynamic", output=out, num_samples=4, seq_len=32,
        eval_samples=1, recipe_gates=False,
    )  # fmt: skip
    fakes = quantize_recording(cfg)
    assert len(fakes) > 8 and decompression_mismatches(out, fakes) == []
    kept, module = STORED_LAYOUT[model_type]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert kept in names and not any(module in n for n in names)
    assert [f for f in inspect(InspectConfig(path=out)).findings if f.level == "error"] == []


def test_routers_inside_a_sibling_module_stay_float(tiny_model):
    """afmoe keeps its router one level down (`mlp.router.gate`, one row per expert): found beside the
    experts, it is never quantized and the export ignores it by name."""
    arch = open_hf_dir(
        tiny_model("afmoe", max_position_embeddings=512, **SIZES, num_experts=8, num_experts_per_tok=2)
    ).arch
    assert "re:.*mlp\\.router\\.gate$" in arch.keep_float


STORED_RULES = {
    # the tower's q/k/v stored fused as `wqkv`, each head's rotary pairs interleaved: transformers chunks
    # and permutes it on load (Chunk, PermuteForRope) under renamed tower prefixes
    "kimi_k25": dict(
        SIZES, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
        n_group=1, topk_group=1,
    ),
    # a rule for the attention's `.norm.` also matches the final `model.norm`, loaded as stored
    "deepseek_v4": dict(
        SIZES, num_key_value_heads=4, q_lora_rank=64, qk_rope_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=64,
    ),
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(STORED_RULES))
def test_stored_names_are_read_as_transformers_loads_them(model_type, tiny_model, tmp_path):
    """Every module tensor reads as transformers holds it after its own load-time rules, the viewed ones
    write back as the files store them (the export's names and values), and a checkpoint missing a
    tensor transformers would fill at random is still refused."""
    from safetensors.torch import save_file

    from fp8ptq.models.skeleton import check_agrees

    path = tiny_model(model_type, max_position_embeddings=512, **STORED_RULES[model_type])
    src = open_hf_dir(path)
    check_agrees(src)
    held = _reference(path).state_dict()
    assert all(torch.equal(src.tensor(n).float(), held[n]) for n in src.weight_map if n in held)
    stored = _tensors(path)
    viewed = src.stored_tensors({n: src.tensor(n) for n in src.views})
    assert viewed.keys() <= stored.keys() and all(torch.equal(t, stored[n]) for n, t in viewed.items())
    cut = tmp_path / "cut"
    cut.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (cut / f.name).write_bytes(f.read_bytes())
    gone = next(n for n in sorted(stored) if n.endswith("wqkv.weight") or n == "model.norm.weight")
    save_file({n: t for n, t in stored.items() if n != gone}, str(cut / "model.safetensors"), {"format": "pt"})
    with pytest.raises(ModelError, match="lacks tensor"):
        check_agrees(open_hf_dir(cut))


def _config(model_type, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=128, max_position_embeddings=512, **SIZES, **extra)


def test_a_layer_list_counted_apart_from_its_sublayers_is_found():
    """longcat_flash's layers each hold two attention and two MLP sublayers: num_hidden_layers counts
    those (4), its layer list num_layers (2); the run and the export count the list."""
    moe = dict(n_routed_experts=4, moe_topk=2, zero_expert_num=0, expert_ffn_hidden_size=32, ffn_hidden_size=64)
    config = _config("longcat_flash", num_hidden_layers=4, q_lora_rank=32, kv_lora_rank=32, **moe)
    arch = discover(config)
    assert (config.num_hidden_layers, arch.layers, arch.layer_count(config)) == (4, "model.layers", 2)
    assert arch.norm_at == "model.norm" and not arch.kv_cache


def test_a_stack_that_widens_its_stream_and_ends_in_a_mixer_is_followed():
    """qwen4_exp_text's stack runs its layers on hc_count residual streams side by side (the embeddings
    repeated) and reduces them with a mixer that holds Linears, not a norm: the first layer's input is
    the stack's own, the store is hc_count * hidden wide, and the mixer is the final module, kept float."""
    linear = dict(linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    layers = dict(num_hidden_layers=2)  # two linear-attention layers (the default types for two)
    config = _config("qwen4_exp_text", hc_lowrank=32, **layers, **linear)
    arch = discover(config)
    assert arch.norm_at == "model.hyper_connection_mixer"
    assert any("hyper_connection_mixer" in k for k in arch.keep_float)
    width = config.hc_count * config.hidden_size
    assert arch.stream_width(arch.skeleton) == width
    embeds = torch.randn(1, 3, config.hidden_size)
    assert torch.equal(arch.enter(arch.skeleton, embeds), embeds.repeat(1, 1, config.hc_count))
    plain = discover(_config("olmo3"))  # a stack whose layers read the embeddings: they stay its first input
    assert plain.stream_width(plain.skeleton) == 64 and plain.enter(plain.skeleton, embeds) is embeds


# hyper-connections: the stack widens the embeddings to 4 residual streams and mixes them back before the
# final norm; its DSA attention masks the indexer's top-k only under transformers' eager/SDPA names
HYPER = dict(
    SIZES,
    num_key_value_heads=4,
    head_dim=32,
    qk_head_dim=32,
    max_position_embeddings=512,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    n_group=1,
    topk_group=1,
    index_topk=4,
    index_head_dim=16,
    index_n_heads=2,
    pad_token_id=0,
)


def test_the_float_stream_is_the_models_own_forward_across_hyper_connections(tiny_model):
    import math

    from fp8ptq.eval.stream import compare_streaming

    path = tiny_model("hy_v4", **HYPER)
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = _reference(path)(input_ids=ids, use_cache=False).logits
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum()
    metrics, _ = compare_streaming(open_hf_dir(path), open_hf_dir(path), ids, simulate_reference=False, simulate=False)
    assert open_hf_dir(path).arch.stream_shape(build_skeleton(open_hf_dir(path).config)) == (4, 64)
    assert metrics["ppl_reference"] == pytest.approx(math.exp(float(nll) / ids[:, 1:].numel()), rel=1e-5)


def test_an_fp8ptq_attention_name_equals_the_function_it_wraps():
    import pickle

    from fp8ptq.models.arch.capture import AttentionName

    name = AttentionName("fp8ptq_eager", "eager")
    assert name == "eager" and name == "fp8ptq_eager" and name in ("eager", "sdpa") and name != "sdpa"
    assert {"fp8ptq_eager": 1}.get(name) == 1 and "eager" not in {name: 1}  # lookups hash its own name
    assert pickle.loads(pickle.dumps(name)) == "eager"
