"""transformers' block-FP8 format -> compressed-tensors block FP8 with the same codes and scales, on a tiny
checkpoint written here in that format (layout from transformers 5.23 `FineGrainedFP8Config` and
`integrations/finegrained_fp8.py`: `weight` float8_e4m3fn, `weight_scale_inv` fp32
[ceil(out/bn), ceil(in/bk)], dequantized as weight * weight_scale_inv)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import save_file

from fp8ptq.api import ConvertConfig, InspectConfig, convert, inspect
from fp8ptq.errors import ModelError

from helpers import parse_config_under, read_tensors

pytestmark = pytest.mark.tiny


def _blocks(scale: torch.Tensor, shape, block) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: shape[0], : shape[1]]


def write_fp8_block(src, dst, block):
    """The float tiny model with every decoder-layer Linear in transformers' block-FP8 format."""
    shutil.copytree(src, dst)
    tensors = read_tensors(dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    for name in [n for n in tensors if ".layers." in n and n.endswith("proj.weight")]:
        w = tensors[name].float()
        rows, cols = math.ceil(w.shape[0] / block[0]), math.ceil(w.shape[1] / block[1])
        amax = torch.zeros(rows, cols)
        for i in range(rows):
            for j in range(cols):
                amax[i, j] = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].abs().max()
        scale = amax / 448.0
        tensors[name] = (w / _blocks(scale, w.shape, block)).clamp(-448, 448).to(torch.float8_e4m3fn)
        tensors[name.replace(".weight", ".weight_scale_inv")] = scale
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("block", [[32, 32], [128, 128]])  # several blocks; one partial block per matrix
def test_block_fp8_carried_exactly(tiny_dir, tmp_path, block):
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    from fp8ptq.eval.quality import load_simulated
    from fp8ptq.models.loader import open_hf_dir

    src = write_fp8_block(tiny_dir, tmp_path / "fp8", block)
    out = tmp_path / "ct"
    report = convert(ConvertConfig(source=src, output=out, to="compressed-tensors"))
    assert report.summary["exact"] == 14
    a, b = read_tensors(src), read_tensors(out)
    sim = load_simulated(open_hf_dir(out), simulate=False).model.state_dict()
    for name in [n for n in a if n.endswith(".weight_scale_inv")]:
        base = name.removesuffix(".weight_scale_inv")
        assert torch.equal(b[f"{base}.weight"].view(torch.uint8), a[f"{base}.weight"].view(torch.uint8))
        assert torch.equal(b[f"{base}.weight_scale"], a[name])
        want = _dequantize_fp8_weight(a[f"{base}.weight"], a[name], block, torch.float32)
        assert torch.equal(sim[f"{base}.weight"], want), base  # compressed-tensors decompresses the same numbers
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["block_structure"] == block
    parse_config_under(qc, "0.17.0")
    parse_config_under(qc, "installed")
    AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert inspect(InspectConfig(path=out)).errors == 0
    assert inspect(InspectConfig(path=src)).format == "hf-fp8-block"


def test_bad_block_fp8_sources(tiny_dir, tmp_path):
    src = write_fp8_block(tiny_dir, tmp_path / "fp8", [32, 32])
    t = read_tensors(src)
    t["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r"up_proj.weight_scale_inv' has shape \(1, 1\)"):
        convert(ConvertConfig(source=src, output=tmp_path / "o", to="compressed-tensors"))
    with pytest.raises(ModelError, match="is a float checkpoint; `convert` writes only gguf from it"):
        convert(ConvertConfig(source=tiny_dir, output=tmp_path / "o", to="compressed-tensors"))
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".o*"))
