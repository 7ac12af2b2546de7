"""Quantize a HF causal LM with llm-compressor, for side-by-side benchmarks with fp8ptq.

Run with the dedicated venv (see benchmarks/setup_llmc_venv.sh). It stays at the top of benchmarks/, not
in a subfolder: ../shared/gpu/README.md, outside this repository, names it by this path.

    benchmarks/.venv-llmc/bin/python benchmarks/llmc_quantize.py \
        --model DIR --calib FILE --scheme fp8-kv8 --out DIR

FILE is a safetensors file holding one int64 tensor ``input_ids`` of shape
[N, L]. Every row is used once, in file order, with an all-ones attention mask.

Schemes:
  fp8-kv8        QuantizationModifier, preset "FP8" (static per-tensor FP8
                 weights + static per-tensor FP8 input activations) plus a static
                 per-tensor FP8 KV cache; lm_head ignored.
  fp8-kv8-gptq   the same with GPTQModifier (GPTQ weights, as fp8ptq's default).
  fp8-dynamic    QuantizationModifier, preset "FP8_DYNAMIC" (per-channel FP8
                 weights, dynamic per-token FP8 activations); data-free.
  w4a16-g64-gptq GPTQModifier, int4 symmetric weights, group size 64; lm_head ignored.
  w8a8-int8      SmoothQuantModifier(0.8) then GPTQModifier preset "W8A8"
                 (per-channel int8 weights, dynamic per-token int8 activations),
                 as in llm-compressor's examples/quantization_w8a8_int8; lm_head ignored.
  fp8-block      QuantizationModifier, preset "FP8_BLOCK" (FP8 weights per 128x128
                 block, dynamic FP8 inputs per group of 128); data-free. Widths that
                 128 does not divide get a partial last block (ceil, with a warning).
  fp8-block-b64  FP8_BLOCK with block_structure [64, 64] and input groups of 64.
  w4afp8-g64-gptq  GPTQModifier with the "W4AFP8" preset (int4 symmetric weights,
                 dynamic per-token FP8 inputs), weight group size 64 instead of 128.
  nvfp4 / nvfp4a16 / mxfp4a16  QuantizationModifier with that preset (RTN weights,
                 as in llm-compressor's examples/quantization_w4a4_fp4 and
                 examples/quantization_w4a16_fp4); nvfp4 calibrates its input global scale.
  nvfp4-gptq / nvfp4a16-gptq  GPTQModifier with the "NVFP4" / "NVFP4A16" preset.
  mxfp4 / mxfp4-gptq  the "MXFP4" preset (W4A4), RTN / GPTQ.
  mxfp4-fp8-gptq  GPTQModifier, MXFP4 weights with FP8_DYNAMIC's per-token FP8 inputs.

Timings: quantize_wall_s covers only the oneshot() call (calibration +
quantization); model load and compressed save are reported separately.
The last stdout line is a JSON summary, also written to OUT/llmc_run.json.
"""

import time

_T0 = time.perf_counter()

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import json
import resource
import sys

SCHEMES = (
    "fp8-kv8",
    "fp8-kv8-gptq",
    "fp8-dynamic",
    "w4a16-g64-gptq",
    "w8a8-int8",
    "fp8-block",
    "fp8-block-b64",
    "w4afp8-g64-gptq",
    "nvfp4",
    "nvfp4-gptq",
    "nvfp4a16",
    "nvfp4a16-gptq",
    "mxfp4a16",
    "mxfp4a16-gptq",
    "mxfp8a16",
    "mxfp8a16-gptq",
    "mxfp8",
    "mxfp8-gptq",
    "mxfp4",
    "mxfp4-gptq",
    "mxfp4-fp8-gptq",
    "w8a16-channel-gptq",
    "w8a16-fp8-gptq",
)
DATA_FREE = ("fp8-dynamic", "fp8-block", "fp8-block-b64", "nvfp4a16", "mxfp4a16", "mxfp8a16", "mxfp8", "mxfp4")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument(
        "--calib",
        help="safetensors file with int64 input_ids [N, L] (required except fp8-dynamic)",
    )
    p.add_argument("--scheme", required=True, choices=SCHEMES)
    p.add_argument("--out", required=True, help="output directory")
    args = p.parse_args(argv)
    if args.scheme not in DATA_FREE and not args.calib:
        p.error(f"--calib is required for scheme {args.scheme}")
    return args


def build_recipe(scheme):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    if scheme == "fp8-kv8":
        kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
        return QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"], kv_cache_scheme=kv)
    if scheme == "fp8-kv8-gptq":  # fp8-kv8 with GPTQ weights: fp8ptq's default fp8-kv8 algorithm
        kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
        return GPTQModifier(targets="Linear", scheme="FP8", ignore=["lm_head"], kv_cache_scheme=kv)
    if scheme == "fp8-dynamic":
        return QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])
    if scheme == "w4a16-g64-gptq":
        w4 = QuantizationScheme(
            targets=["Linear"],
            weights=QuantizationArgs(
                num_bits=4,
                type="int",
                strategy="group",
                group_size=64,
                symmetric=True,
                dynamic=False,
            ),
        )
        return GPTQModifier(config_groups={"group_0": w4}, ignore=["lm_head"])
    if scheme == "w8a8-int8":
        return [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
        ]
    return build_format_recipe(scheme)


def build_format_recipe(scheme):
    """The issue-17 formats: llm-compressor's presets (block / group size reduced where named)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    def preset(name, **weights):
        p = PRESET_SCHEMES[name]
        kw = {k: v.model_copy(deep=True) for k, v in p.items()}
        for k, v in weights.items():
            setattr(kw["weights"], k, v)
        return QuantizationScheme(targets=["Linear"], **kw)

    if scheme == "fp8-block-b64":
        s = preset("FP8_BLOCK", block_structure=[64, 64])
        s.input_activations.group_size = 64
        return QuantizationModifier(config_groups={"group_0": s}, ignore=["lm_head"])
    if scheme == "w8a16-channel-gptq":  # the W8A16 preset per output channel (its group 128 does not divide 576)
        return GPTQModifier(
            config_groups={"group_0": preset("W8A16", strategy="channel", group_size=None)}, ignore=["lm_head"]
        )
    if scheme == "w8a16-fp8-gptq":  # FP8_DYNAMIC's per-channel FP8 weights, no input quantization
        fp8 = QuantizationScheme(targets=["Linear"], weights=PRESET_SCHEMES["FP8_DYNAMIC"]["weights"].model_copy())
        return GPTQModifier(config_groups={"group_0": fp8}, ignore=["lm_head"])
    if scheme == "mxfp4-fp8-gptq":  # MXFP4 weights + FP8_DYNAMIC's per-token FP8 inputs (ct 0.19 has no MXFP4XFP8)
        s = preset("MXFP4")
        s.input_activations = PRESET_SCHEMES["FP8_DYNAMIC"]["input_activations"].model_copy()
        return GPTQModifier(config_groups={"group_0": s}, ignore=["lm_head"])
    if scheme == "w4afp8-g64-gptq":
        return GPTQModifier(config_groups={"group_0": preset("W4AFP8", group_size=64)}, ignore=["lm_head"])
    if scheme.endswith("-gptq"):
        return GPTQModifier(targets="Linear", scheme=scheme[: -len("-gptq")].upper(), ignore=["lm_head"])
    names = {"fp8-block": "FP8_BLOCK", "nvfp4": "NVFP4", "nvfp4a16": "NVFP4A16", "mxfp4a16": "MXFP4A16"}
    names.update({"mxfp8a16": "MXFP8A16", "mxfp8": "MXFP8", "mxfp4": "MXFP4"})
    return QuantizationModifier(targets="Linear", scheme=names[scheme], ignore=["lm_head"])


def load_calibration(path):
    """Calibration rows as a (sequential, unshuffled) DataLoader over a Dataset."""
    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    tensors = load_file(path)
    if set(tensors) != {"input_ids"}:
        raise ValueError(f"{path}: expected exactly one tensor 'input_ids', got {sorted(tensors)}")
    ids = tensors["input_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"{path}: input_ids must be int64 [N, L], got {ids.dtype} {tuple(ids.shape)}")
    n, seq_len = ids.shape
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}).with_format(
        "torch"
    )

    def collate(rows):
        return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "attention_mask")}

    # oneshot() would wrap a Dataset in a LengthAwareSampler, whose (unstable)
    # argsort permutes equal-length rows; a plain DataLoader keeps file order.
    loader = DataLoader(ds, batch_size=1, shuffle=False, collate_fn=collate)
    return loader, n, seq_len


def main(argv=None):
    args = parse_args(argv)

    import llmcompressor
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.makedirs(args.out, exist_ok=True)

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load_s = time.perf_counter() - t

    kwargs = {}
    n = seq_len = None
    if args.scheme not in DATA_FREE:
        loader, n, seq_len = load_calibration(args.calib)
        kwargs = dict(
            dataset=loader,
            max_seq_length=seq_len,
            num_calibration_samples=n,
            shuffle_calibration_samples=False,
        )
    recipe = build_recipe(args.scheme)

    t = time.perf_counter()
    model = oneshot(model=model, recipe=recipe, **kwargs)
    quantize_s = time.perf_counter() - t

    t = time.perf_counter()
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    save_s = time.perf_counter() - t

    result = {
        "tool": "llm-compressor",
        "version": llmcompressor.__version__,
        "scheme": args.scheme,
        "quantize_wall_s": round(quantize_s, 3),
        "total_wall_s": round(time.perf_counter() - _T0, 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "out": os.path.abspath(args.out),
        "load_wall_s": round(load_s, 3),
        "save_wall_s": round(save_s, 3),
        "calib_samples": n,
        "calib_seq_len": seq_len,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    line = json.dumps(result)
    with open(os.path.join(args.out, "llmc_run.json"), "w") as f:
        f.write(line + "\n")
    sys.stdout.flush()
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
