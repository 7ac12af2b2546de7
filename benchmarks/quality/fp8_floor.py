"""What FP8 W8A8 static + FP8 KV costs by part, in and off the calibration domain (issue 21).

Quantizes one part at a time in the fp32 model, by the plain rules every tool starts from: weights
FP8 per-tensor round-to-nearest (min-max scale), static per-tensor FP8 inputs and per-layer FP8 keys /
values with min-max scales over the calibration tokens (the engine's numerics: fp8ptq.ops.grid), and
scores each variant against the unquantized model on held-out in-domain tokens and on an off-domain
text: mean KL(ref || quantized) over every predicted position, and top-1 agreement.

The rows with the weights unquantized are a floor for any weight-side method (GPTQ, scale search):
what the activations and the KV cache cost on their own. The row with every part quantized is what
llm-compressor's FP8 + KV8 preset computes (min-max everywhere), a check that this script's evaluator
agrees with `fp8ptq eval quality` (BENCHMARKS.md compares the two).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python benchmarks/quality/fp8_floor.py --eval-data licences.txt
        [--kv-head]   # + the KV rows with one scale per KV head (compressed-tensors attn_head)
        [--query]     # + rows with the attention's query in FP8 (post-RoPE, per layer): scale 1.0, what
                      #   vLLM 0.32 uses on GPUs whose attention quantizes the query (FlashAttention 3,
                      #   FlashInfer trtllm-gen, Triton) when the checkpoint has no q_scale, and min-max
                      #   (a calibrated q_scale)
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

from fp8ptq.data import load_samples
from fp8ptq.models.loader import resolve_model
from fp8ptq.ops.fp8 import fake_quant_fp8
from fp8ptq.ops.granularity import TENSOR
from fp8ptq.ops.grid import FP8_GRID
from fp8ptq.quantization.numerics import register_attention

# (weights, inputs, KV): 0 float, else FP8 with the min-max scale times this headroom factor
VARIANTS = ((1, 0, 0), (0, 1, 0), (0, 0, 1), (0, 1, 1), (1, 1, 1))


def mark(on) -> str:
    return ("FP8 min-max" + (f" x{on:g}" if on != 1 else "")) if on else "float"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--eval-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-data", required=True, help="off-domain text (any local .txt)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument(
        "--headroom",
        type=float,
        nargs="*",
        default=[],
        help="also score the inputs + KV row with static scales this many times the calibration max",
    )
    ap.add_argument(
        "--kv-head", action="store_true", help="also score the KV rows with one min-max scale per KV head (attn_head)"
    )
    ap.add_argument("--query", action="store_true", help="also score rows with the query in FP8 (scale 1.0, min-max)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(src.path)
    calib = load_samples("builtin", tok, args.calib_samples, args.seq_len, "calibration", seed=0)
    sets = {
        "in-domain": load_samples("builtin", tok, args.eval_samples, args.seq_len, "evaluation", seed=0),
        "off-domain": load_samples(args.eval_data, tok, args.eval_samples, args.seq_len, "evaluation", seed=0),
    }
    model = AutoModelForCausalLM.from_pretrained(
        src.path, dtype=torch.float32, attn_implementation=register_attention()
    )
    model.eval()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not model.lm_head}
    attns = {n: m for n, m in model.named_modules() if n.endswith("self_attn")}
    original = {n: m.weight.data.clone() for n, m in linears.items()}

    # min-max statistics over the calibration tokens (float model)
    amax: dict[str, float] = defaultdict(float)
    head_amax: dict[str, torch.Tensor] = {}  # per KV head: [kv_heads]

    def observe_input(name):
        return lambda _m, a: amax.__setitem__(name, max(amax[name], float(a[0].abs().max())))

    def observe_kv(name):
        def hook(_m, k, v):
            amax[name + ".k"] = max(amax[name + ".k"], float(k.abs().max()))
            amax[name + ".v"] = max(amax[name + ".v"], float(v.abs().max()))
            for t, x in (("k", k), ("v", v)):  # [n, kv_heads, seq, head_dim]
                h = x.abs().amax(dim=(0, 2, 3))
                head_amax[f"{name}.{t}"] = torch.maximum(head_amax.get(f"{name}.{t}", h), h)
            return k, v

        return hook

    def observe_query(name):
        def inner(module, query, *rest, **kwargs):
            amax[name + ".q"] = max(amax[name + ".q"], float(query.abs().max()))
            return sdpa(module, query, *rest, **kwargs)

        return inner

    handles = [m.register_forward_pre_hook(observe_input(n)) for n, m in linears.items()]
    for n, a in attns.items():
        a.fp8ptq_kv_hook = observe_kv(n)
        a.fp8ptq_inner_attention = observe_query(n)
    with torch.inference_mode():
        for i in range(0, len(calib), args.batch):
            model(calib[i : i + args.batch])
    for h in handles:
        h.remove()

    def logprobs(ids):
        with torch.inference_mode():
            for i in range(0, len(ids), args.batch):
                yield torch.log_softmax(model(ids[i : i + args.batch]).logits.float(), -1)[:, :-1]

    for a in attns.values():
        a.__dict__.pop("fp8ptq_kv_hook", None)
        a.__dict__.pop("fp8ptq_inner_attention", None)
    reference = {s: list(logprobs(ids)) for s, ids in sets.items()}

    def static(scale):
        return lambda t: FP8_GRID.fake_quant(t, scale)

    def per_head(amax_heads):
        qs = [static(FP8_GRID.scale(float(a))) for a in amax_heads]
        return lambda t: torch.stack([q(t[:, h]) for h, q in enumerate(qs)], dim=1)

    print(
        f"{args.model}: calibration {args.calib_samples} x {args.seq_len} (built-in split), evaluation "
        f"{args.eval_samples} x {args.seq_len} in-domain (built-in held-out split) and off-domain ({args.eval_data})"
    )
    print("| weights | inputs | KV (scale = min-max x factor) | query | in-domain KL | top-1 | off-domain KL | top-1 |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    variants = [(*v, 0) for v in VARIANTS] + [(0, h, h, 0) for h in args.headroom]
    variants += [(0, 0, "head", 0), (0, 1, "head", 0)] * args.kv_head
    variants += [(0, 0, 1, "one"), (0, 0, 1, "minmax"), (0, 1, 1, "one"), (0, 1, 1, "minmax")] * args.query
    for w, x, kv, qq in variants:
        handles = []
        for n, m in linears.items():
            m.weight.data = (
                fake_quant_fp8(original[n], FP8_GRID.scale(float(original[n].abs().max())), TENSOR)
                if w
                else original[n]
            )
            if x:
                q = static(FP8_GRID.scale(amax[n] * x))
                handles.append(m.register_forward_pre_hook(lambda _m, a, q=q: (q(a[0]), *a[1:])))
        for n, a in attns.items():
            a.__dict__.pop("fp8ptq_kv_hook", None)
            a.__dict__.pop("fp8ptq_inner_attention", None)
            if qq:
                q = static(torch.ones(1) if qq == "one" else FP8_GRID.scale(amax[f"{n}.q"]))
                a.fp8ptq_inner_attention = lambda m, query, *r, q=q, **kw: sdpa(m, q(query), *r, **kw)
            if kv == "head":
                kq, vq = (per_head(head_amax[f"{n}.{t}"]) for t in "kv")
                a.fp8ptq_kv_hook = lambda _m, k, v, kq=kq, vq=vq: (kq(k), vq(v))
            elif kv:
                kq, vq = (static(FP8_GRID.scale(amax[f"{n}.{t}"] * kv)) for t in "kv")
                a.fp8ptq_kv_hook = lambda _m, k, v, kq=kq, vq=vq: (kq(k), vq(v))
        cells = []
        for s, ids in sets.items():
            kl = top = count = 0.0
            for ref, got in zip(reference[s], logprobs(ids)):
                kl += float((ref.exp() * (ref - got)).sum())
                top += float((ref.argmax(-1) == got.argmax(-1)).sum())
                count += ref.shape[0] * ref.shape[1]
            cells += [f"{kl / count:.5f}", f"{top / count:.2%}"]
        for h in handles:
            h.remove()
        marks = [mark(w), mark(x), "FP8 min-max per KV head" if kv == "head" else mark(kv)]
        marks.append({0: "float", "one": "FP8 scale 1.0", "minmax": "FP8 min-max"}[qq])
        print("| " + " | ".join(marks + cells) + " |", flush=True)


if __name__ == "__main__":
    main()
