"""Real speculative-decoding speedups on a GPU with fp8ptq's own harness (HF transformers, batch 1, bf16).

Runs where only torch + transformers exist (no compressed-tensors, no vLLM): the target is a plain HF
directory (the bf16 SmolLM2 here), the draft a draft-train output. Measures, per γ and temperature,
wall-clock tokens/s of speculative decoding (fp8ptq.spec.measure.speculative_generate) against plain
decoding with the same cache and sampling code (plain_generate), plus the costs (draft step, target over
k tokens) and the predicted speedup from them.

    python3 benchmarks/spec/spec_gpu.py --target DIR --draft DIR --prompts prompts.json --out result.json
    (prompts.json: a list of token-id lists, e.g. the held-out prompts `spec measure --save` stored)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fp8ptq.spec.measure import Decoding, SpecStats, measure_costs, plain_generate, speculative_generate
from fp8ptq.spec.models import LoadedModel
from fp8ptq.spec.recommend import speedup_from_steps


def load(path: str, device: str, embed_from=None) -> LoadedModel:
    """An HF dir in bf16. embed_from: take the (tied) embedding from this model when the draft dir was
    shipped without it (it is the target's own embedding)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    files = sorted(Path(path).glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    if "model.embed_tokens.weight" not in state:
        state["model.embed_tokens.weight"] = embed_from.model.model.embed_tokens.weight.detach().cpu()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()}, strict=False, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval()
    return LoadedModel(model, int(cfg.vocab_size), None, path)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    _sync()
    t = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gammas", type=int, nargs="*", default=[1, 2, 3, 4, 5, 6, 7, 8])
    ap.add_argument("--temperatures", type=float, nargs="*", default=[0.0, 1.0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args()
    dev = args.device
    target = load(args.target, dev)
    draft = load(args.draft, dev, embed_from=target)
    prompts = json.loads(Path(args.prompts).read_text())[: args.num_prompts]
    result = {
        "device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "by_temperature": {},
    }
    import transformers

    result["transformers"] = transformers.__version__
    # warm-up (cuBLAS handles, sdpa kernels)
    plain_generate(target, prompts[0], max_tokens=8, device=dev)
    speculative_generate(target, draft, prompts[0], Decoding(gamma=4, max_tokens=8, device=dev))
    costs = measure_costs(
        target, draft, prompts[0] + prompts[0][:32], max_k=max(args.gammas) + 1, repeats=11, device=dev
    )
    result["costs"] = costs.as_dict()
    print(
        f"costs: target {costs.t_target * 1e3:.2f} ms, draft {costs.t_draft * 1e3:.2f} ms, c = {costs.c:.3f}",
        flush=True,
    )
    for temp in args.temperatures:
        rows = []
        base_out, base_s = timed(
            lambda: [
                plain_generate(
                    target,
                    p,
                    max_tokens=args.max_tokens,
                    temperature=temp,
                    generator=torch.Generator().manual_seed(i),
                    device=dev,
                )
                for i, p in enumerate(prompts)
            ]
        )
        n = sum(len(o) for o in base_out)
        rows.append({"gamma": 0, "tokens_per_s": n / base_s, "seconds": base_s})
        result["by_temperature"][str(temp)] = rows
        print(f"T={temp} plain: {n / base_s:.1f} tokens/s", flush=True)
        for g in args.gammas:
            stats = SpecStats(g)
            outs, s = timed(
                lambda: [
                    speculative_generate(
                        target,
                        draft,
                        p,
                        Decoding(g, args.max_tokens, temperature=temp, device=dev),
                        generator=torch.Generator().manual_seed(i),
                        stats=stats,
                    )
                    for i, p in enumerate(prompts)
                ]
            )
            summ = stats.summary()
            same = sum(a == b for a, b in zip(outs, base_out)) if temp == 0 else None
            rows.append(
                {
                    "gamma": g,
                    "tokens_per_s": n / s,
                    "seconds": s,
                    "speedup_measured": base_s / s,
                    "speedup_predicted": speedup_from_steps(summ.steps(), summ.emitted, costs),
                    "tau": summ.tau,
                    "alpha": summ.alpha,
                    "alpha_per_pos": summ.alpha_per_pos,
                    "outputs_equal_plain": same,
                }
            )
            args.out.write_text(json.dumps(result, indent=1))  # partial results survive a time limit
            print(
                {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items() if k != "alpha_per_pos"},
                flush=True,
            )
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["costs"], indent=1))


if __name__ == "__main__":
    main()
