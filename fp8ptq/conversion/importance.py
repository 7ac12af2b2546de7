"""Per-column importance of every matrix for `convert --to gguf --gguf-type T --importance DATA`.

The importance of input column j of a Linear is the mean of x_j^2 over calibration tokens: the diagonal of
the Hessian of the layer's output error, which GPTQ's solver uses in full (fp8ptq's calibration) and
llama.cpp's `llama-imatrix` computes for its K-quant search. The block search (ops/kquant.py,
ops/kquant.py `quantize_block32`) weighs each weight's squared error by it. The tied embedding takes the LM
head's statistics (llama.cpp quantizes the tied matrix by the output's rule); an untied embedding is a
lookup, with no input statistics, and is searched unweighted.

The model is held whole in fp32 (eval/quality.load_simulated with simulate=False: a compressed-tensors
source dequantized, what a plain HF load computes); one forward pass per batch of samples.
"""

from __future__ import annotations

import torch

from fp8ptq.models.loader import ModelSource


@torch.inference_mode()
def collect(
    src: ModelSource, data: str, num_samples: int, seq_len: int, batch_size: int = 4
) -> dict[str, torch.Tensor]:
    """HF weight name -> mean x^2 [in_features] of that matrix's input, over `num_samples` x `seq_len` tokens of
    `data` (fp8ptq.data sources: 'builtin', a file, a mix)."""
    from fp8ptq.data import load_samples
    from fp8ptq.eval.quality import load_simulated

    model = load_simulated(src, simulate=False).model
    ids = load_samples(data, src.tokenizer(), num_samples, seq_len, "calibration")
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):

            def hook(mod, args, name=name):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                acc = sums.get(name)
                sq = x.pow(2).sum(0)
                sums[name] = sq if acc is None else acc + sq

            hooks.append(module.register_forward_pre_hook(hook))
    try:
        for start in range(0, ids.shape[0], batch_size):
            model(ids[start : start + batch_size])
    finally:
        for h in hooks:
            h.remove()
    tokens = ids.numel()
    out = {f"{name}.weight": s / tokens for name, s in sums.items()}
    tied = not any(n.startswith("lm_head.") for n in src.weight_map)
    if "lm_head.weight" in out and tied:  # the embedding is the head
        embed = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
        out[f"{embed}.weight"] = out.pop("lm_head.weight")
    return out
