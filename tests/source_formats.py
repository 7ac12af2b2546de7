"""Writers of other tools' quantized checkpoint layouts, from a float HF directory, for the converter's tests.

Written from the published layouts, independently of fp8ptq/conversion/ and fp8ptq/ops/int_pack.py:
- GPTQ: AutoGPTQ 0.7.1 `auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py` `QuantLinear.pack` (and GPTQModel
  2.x `gptqmodel/nn_modules/qlinear/__init__.py` `pack`): qweight int32 [in/k, out], k = 32/bits codes of
  consecutive input rows per word (row i*k+j at bit bits*j); qzeros int32 [groups, out/k] packed the same
  way along the output dim, holding zero - 1 in the v1 format (`checkpoint_format: gptq`) and the zero in
  GPTQModel's `gptq_v2`; scales fp16 [groups, out]; g_idx int32 [in] (act order: the group of each input
  column); config `quantization_config {quant_method: gptq, bits, group_size, desc_act, sym,
  checkpoint_format}`. Dequantization (q - z[g_idx]) * s[g_idx] (`dequantize_weight` in GPTQModel's
  torch kernel).
- AWQ: AutoAWQ 0.2.x `awq/modules/linear/gemm.py` `WQLinear_GEMM.from_linear` with `AWQ_ORDER =
  [0, 2, 4, 6, 1, 3, 5, 7]` (`awq/utils/packing_utils.py`): qweight int32 [in, out/8] and qzeros int32
  [groups, out/8], 8 output columns per word, column c*8 + AWQ_ORDER[p] at bit 4p; scales fp16
  [groups, out]; config `{quant_method: awq, bits, group_size, zero_point: true, version: gemm}`.
- ModelOpt: TensorRT-Model-Optimizer 0.2x `modelopt/torch/export/unified_export_hf.py` and
  `quant_utils.py`: hf_quant_config.json `{producer: {name: modelopt}, quantization: {quant_algo,
  kv_cache_quant_algo, exclude_modules}}`; FP8: weight float8_e4m3fn, weight_scale = amax / 448 fp32
  scalar, input_scale fp32 scalar, self_attn.k_proj.k_scale / v_proj.v_scale; NVFP4: weight uint8
  [out, in/2] (E2M1 codes, low nibble = even column), weight_scale float8_e4m3fn [out, in/16],
  weight_scale_2 fp32 scalar, input_scale fp32 scalar.
Each writer returns {module: dequantized fp32 weight} (the source's own dequantization).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import torch
from safetensors.torch import save_file

from helpers import read_tensors

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _linears(tensors: dict) -> list[str]:
    return sorted(n.removesuffix(".weight") for n in tensors if ".layers." in n and n.endswith("proj.weight"))


def _start(src, dst, qc: dict | None):
    shutil.copytree(src, dst)
    tensors = read_tensors(dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    cfg = json.loads((dst / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return tensors


def _save(dst, tensors):
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"}
    )


def _words(fields: np.ndarray, bits: int) -> torch.Tensor:
    """[..., k] unsigned fields (low first) -> int32 words [...]."""
    k = fields.shape[-1]
    acc = np.zeros(fields.shape[:-1], dtype=np.uint64)
    for j in range(k):
        acc |= (fields[..., j].astype(np.uint64) & ((1 << bits) - 1)) << np.uint64(bits * j)
    return torch.from_numpy(acc.astype(np.uint32).view(np.int32))


def _rtn(w: torch.Tensor, g_idx: torch.Tensor, groups: int, bits: int, sym: bool):
    """Round-to-nearest unsigned codes [out, in], zeros [out, G] (int), fp16 scales [out, G]."""
    maxq = (1 << bits) - 1
    scales = torch.zeros(w.shape[0], groups, dtype=torch.float16)
    zeros = torch.zeros(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = (2 * cols.abs().amax(1) / maxq).clamp_min(1e-5)
            z = torch.full_like(s, (maxq + 1) // 2)
        else:
            lo, hi = cols.amin(1).clamp_max(0), cols.amax(1).clamp_min(0)
            s = ((hi - lo) / maxq).clamp_min(1e-5)
            z = torch.round(-lo / s.half().float()).clamp(0, maxq)
        scales[:, g], zeros[:, g] = s.half(), z.long()
    sf = scales.float()[:, g_idx]
    codes = torch.clamp(torch.round(w / sf) + zeros[:, g_idx], 0, maxq).long()
    return codes, zeros, scales


def write_gptq(src, dst, bits=4, group_size=32, sym=True, v2=False, act_order=False, zero_edit=None) -> dict:
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": sym}
    qc["checkpoint_format"] = "gptq_v2" if v2 else "gptq"
    tensors = _start(src, dst, qc)
    k, ref = 32 // bits, {}
    gen = torch.Generator().manual_seed(0)
    for name in _linears(tensors):
        w = tensors.pop(f"{name}.weight").float()
        n_in = w.shape[1]
        gs = n_in if group_size == -1 else group_size
        g_idx = torch.arange(n_in) // gs
        if act_order:  # GPTQ's desc_act: columns quantized in a permuted order, groups of consecutive ones
            g_idx = g_idx[torch.argsort(torch.randperm(n_in, generator=gen))]
        codes, zeros, scales = _rtn(w, g_idx, n_in // gs, bits, sym)
        if zero_edit is not None:
            zeros = zero_edit(name, zeros)
        ref[name] = (codes - zeros[:, g_idx]).float() * scales.float()[:, g_idx]
        stored = zeros - (0 if v2 else 1)  # AutoGPTQ v1 stores zero - 1 (a -1 wraps in the mask)
        rows = codes.T.numpy().reshape(n_in // k, k, -1).transpose(0, 2, 1)  # [in/k, out, k]
        tensors[f"{name}.qweight"] = _words(rows, bits)
        tensors[f"{name}.qzeros"] = _words(stored.T.numpy().reshape(stored.shape[1], -1, k), bits)
        tensors[f"{name}.scales"] = scales.T.contiguous()
        tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    _save(dst, tensors)
    return ref


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def write_awq(src, dst, group_size=32) -> dict:
    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    tensors = _start(src, dst, qc)
    ref = {}
    for name in _linears(tensors):
        w = tensors.pop(f"{name}.weight").float()
        g_idx = torch.arange(w.shape[1]) // group_size
        codes, zeros, scales = _rtn(w, g_idx, w.shape[1] // group_size, 4, sym=False)
        ref[name] = (codes - zeros[:, g_idx]).float() * scales.float()[:, g_idx]
        for key, t in (("qweight", codes.T), ("qzeros", zeros.T)):  # [rows, out]
            blocks = t.numpy().reshape(t.shape[0], -1, 8)[..., AWQ_ORDER]  # position p holds column AWQ_ORDER[p]
            tensors[f"{name}.{key}"] = _words(blocks, 4)
        tensors[f"{name}.scales"] = scales.T.contiguous()
    _save(dst, tensors)
    return ref


def _fused(name: str) -> str:
    """The fused GEMM a shard belongs to (q/k/v, gate/up)."""
    parent, _, leaf = name.rpartition(".")
    return parent + "." + {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}.get(leaf, leaf)


def write_modelopt(src, dst, algo="FP8", kv=True, exclude=("lm_head",)) -> dict:
    tensors = _start(src, dst, None)
    hq = {"quant_algo": algo, "kv_cache_quant_algo": "FP8" if kv else None, "exclude_modules": list(exclude)}
    if algo == "NVFP4":
        hq["group_size"] = 16
    (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": hq}))
    ref, inputs, globals_ = {}, {}, {}
    gen = torch.Generator().manual_seed(1)
    for name in _linears(tensors):
        w = tensors.pop(f"{name}.weight").float()
        if algo == "NVFP4":
            codes = torch.randint(0, 16, w.shape, generator=gen, dtype=torch.uint8)
            scale = (torch.rand(w.shape[0], w.shape[1] // 16, generator=gen) * 2 + 0.1).to(torch.float8_e4m3fn)
            # not a power of two (its reciprocal rounds); one per fused GEMM, as ModelOpt's export unifies it
            ws2 = globals_.setdefault(_fused(name), torch.tensor(0.0123 * (len(globals_) + 1))).clone()
            tensors[f"{name}.weight"] = codes[:, 0::2] | (codes[:, 1::2] << 4)
            tensors[f"{name}.weight_scale"], tensors[f"{name}.weight_scale_2"] = scale, ws2
            ref[name] = E2M1[codes.long()] * scale.float().repeat_interleave(16, 1) * ws2
        else:
            scale = w.abs().amax(1, keepdim=True) / 448 if algo != "FP8" else w.abs().amax() / 448
            q = (w / scale).to(torch.float8_e4m3fn)
            tensors[f"{name}.weight"] = q
            tensors[f"{name}.weight_scale"] = scale.reshape(-1) if algo != "FP8" else scale
            ref[name] = q.float() * scale
        if algo != "FP8_PER_CHANNEL_PER_TOKEN":  # fused shards (one input) share it, as ModelOpt writes them
            tensors[f"{name}.input_scale"] = inputs.setdefault(_fused(name), torch.tensor(0.01 * (len(inputs) + 1)))
            tensors[f"{name}.input_scale"] = tensors[f"{name}.input_scale"].clone()
        if kv and name.endswith(("k_proj", "v_proj")):
            tensors[f"{name}.{name[-6]}_scale"] = torch.tensor(0.02)
    _save(dst, tensors)
    return ref
