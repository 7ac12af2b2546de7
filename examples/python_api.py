"""fp8ptq from Python: a model held in memory, a built-in recipe edited in Python, one typed result.

    .venv/bin/python examples/python_api.py [MODEL_DIR] [OUT]

MODEL_DIR defaults to the embedded SmolLM2-135M (the `smollm2-135m` alias, converted once into the cache).
The export is the one `fp8ptq quantize MODEL_DIR -r w8a8-int8 --set calibration.weight_method=rtn ...` writes;
the suite runs this script and compares the two (tests/test_library.py).
"""

from __future__ import annotations

import sys

import fp8ptq

# what the CLI runs for the same export (tests/test_library.py holds the two equal)
CLI_ARGS = ["-r", "w8a8-int8", "--set", "calibration.weight_method=rtn", "--num-samples", "4", "--seq-len", "128"]
CLI_ARGS += ["--eval-samples", "1"]


def quantize_in_memory(model, tokenizer, out: str) -> fp8ptq.QuantizeResult:
    recipe = fp8ptq.Recipe.builtin("w8a8-int8").set("calibration.weight_method", "rtn")  # SmoothQuant, no GPTQ
    return fp8ptq.quantize(
        model, recipe, out, tokenizer=tokenizer, num_samples=4, seq_len=128, eval_samples=1, overwrite=True
    )


def main(model_dir: str | None = None, out: str = "out/python-api") -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir is None:
        from fp8ptq.models import resolve_model

        model_dir = str(resolve_model("smollm2-135m").path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")  # e.g. just fine-tuned
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    result = quantize_in_memory(model, tokenizer, out)
    q = result.manifest.quality
    print(f"{result.output}: KL {q.kl:.5f}, top-1 {100 * q.top1:.2f}%, gates {'passed' if result.passed else 'FAILED'}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
