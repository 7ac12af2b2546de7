"""Architecture adapters: the registry, typed errors, and — for every registered family, on a tiny
random model built from transformers' own config class — that the adapter describes the layer the
model really runs (running its blocks reproduces the model's own decoder layer)."""

import pytest
import torch

from fp8ptq.errors import ModelError
from fp8ptq.models.arch import ARCHS, arch_for, registered
from fp8ptq.models.loader import open_hf_dir
from fp8ptq.models.skeleton import load_float

pytestmark = pytest.mark.tiny


def test_registry_and_unknown_model_type():
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(registered())
    with pytest.raises(ModelError) as e:
        arch_for({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})  # Conv1D, not nn.Linear
    assert "'gpt2': its decoder layers hold no nn.Linear (" in str(e.value) and "Conv1D" in str(e.value)


@pytest.mark.parametrize("model_type", registered())
def test_adapter_describes_the_layer(model_type, tiny_model):
    src = open_hf_dir(tiny_model(model_type))
    arch = src.arch
    assert arch is ARCHS[model_type]
    model = load_float(src)
    layers = arch.decoder_layers(model)
    modules = dict(layers[0].named_modules())
    linears = {n.rpartition(".")[2] for n, m in modules.items() if isinstance(m, torch.nn.Linear)}
    for shards in arch.fused.values():  # fused shards are all there or none is
        assert set(shards) <= linears or not set(shards) & linears, shards
    for g in arch.smooth:
        assert g.norm in modules and all(n in modules for n in g.linears), g
    if arch.flatten is not None:
        assert all(n in modules for n in (arch.flatten.gate, arch.flatten.up, arch.flatten.down))
    assert arch.attention in modules
    for i, layer in enumerate(layers):
        arch.check_layer(layer, i)

    # the adapter's blocks, run one after the other, are the model's own decoder layer
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        hidden = model(ids, output_hidden_states=True).hidden_states
        inputs = arch.layer_inputs(model, ids.shape[1], "cpu")
        x = hidden[0]
        for i, layer in enumerate(layers[:-1]):  # the last hidden state is after the final norm
            for block in arch.blocks:
                x = arch.run_block(layer, block, x, inputs(i))
            torch.testing.assert_close(x, hidden[i + 1], rtol=1e-5, atol=1e-5)


def test_a_layer_the_adapter_does_not_know_is_a_typed_error():
    arch = ARCHS["llama"]
    with pytest.raises(ModelError, match="not a llama layer"):
        arch.check_layer(torch.nn.Module(), 0)
