"""What fp8ptq asks vLLM for: a job's max_model_len never exceeds the positions the checkpoint states."""

from __future__ import annotations

import json

import pytest

from fp8ptq.engine.vllm import vllm_request


@pytest.mark.parametrize(
    "config",
    [{"max_position_embeddings": 512}, {"text_config": {"max_position_embeddings": 512}, "vision_config": {}}],
    ids=["top-level", "multimodal text config"],
)
def test_max_model_len_is_capped_at_the_models_positions(config, tmp_path):
    """vLLM refuses a max_model_len over the derived one (a ModelConfig validation error)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vllm_request(tmp_path, [[1, 2]], 4)["max_model_len"] == 512
    assert vllm_request(tmp_path, [[1, 2]], 4, max_model_len=256)["max_model_len"] == 256
