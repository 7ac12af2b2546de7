"""Decoder stacks whose layers' inputs depend on the tokens beyond the embedding (models/arch/tokens.py):
Gemma 4's per-layer inputs, from its per-layer embeddings and their projection, on a tiny random model."""

import pytest
import torch

from fp8ptq.errors import ModelError
from fp8ptq.models.arch.generic import GenericArch
from fp8ptq.models.arch.tokens import reads_tokens, sample_inputs
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.models.skeleton import build_skeleton, load_float

pytestmark = pytest.mark.tiny

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_each_sample_gets_the_per_layer_inputs_of_the_models_own_forward(tiny_model):
    from transformers import AutoModelForCausalLM

    path = tiny_model("gemma4_text", layers=3, max_position_embeddings=512, hidden_size_per_layer_input=16, **SIZES)
    src = open_hf_dir(path)
    arch = src.arch
    assert isinstance(arch, GenericArch) and reads_tokens(arch)
    assert {n.rpartition(".")[2] for n in arch.stack_inputs} >= {"embed_tokens_per_layer", "per_layer_model_projection"}
    ids = torch.randint(0, src.text_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model = load_float(src)
    skeleton = build_skeleton(src.config)
    shared = arch.layer_inputs(skeleton, ids.shape[1], "cpu")
    with torch.inference_mode():
        hidden = reference(input_ids=ids, output_hidden_states=True).hidden_states
        for i, x, own in sample_inputs(arch, skeleton, src, ids, shared, samples=range(2), device="cpu"):
            torch.testing.assert_close(x, hidden[0][i : i + 1])
            for j, layer in enumerate(arch.decoder_layers(model)[:-1]):  # the last hidden state is normed
                x = arch.run_block(layer, arch.blocks[0], x, own[j])
                torch.testing.assert_close(x, hidden[j + 1][i : i + 1], rtol=1e-4, atol=1e-4)
        # the zero-input capture's per-layer input is not a sample's: calibration must not use it
        assert not torch.equal(own[1].args[0], shared(1).args[0])


def test_a_stack_threading_a_second_stream_between_layers_is_refused(tiny_model):
    path = tiny_model("zaya", max_position_embeddings=512, num_experts=8, num_experts_per_tok=1, **SIZES)
    src = open_hf_dir(path)
    with pytest.raises(ModelError, match="second stream"):
        src.arch.layer_inputs(build_skeleton(src.config), 8, "cpu")
