"""llama.cpp's side of benchmarks/engines/llamacpp_check.py, run by .venv-llama's python (`make llama`): it imports
llama-cpp-python and numpy only.

    python llamacpp_worker.py logits GGUF TOKENS.npy OUT.npz [GREEDY_PROMPT_LEN GREEDY_NEW]
        llama.cpp's logits of every position of every row of TOKENS ([rows, T] int32), and the greedy
        continuation of row 0's first GREEDY_PROMPT_LEN tokens
    python llamacpp_worker.py tokenize GGUF TEXTS.json
        llama.cpp's token ids of each text (JSON list of lists on stdout)
    python llamacpp_worker.py quantize SRC.gguf OUT.gguf FTYPE
        llama.cpp's own quantizer (llama_model_quantize, no importance matrix), FTYPE e.g. Q4_K_M
"""

from __future__ import annotations

import json
import sys

import numpy as np


def logits(gguf: str, tokens_path: str, out: str, prompt_len: int = 32, new: int = 32) -> None:
    from llama_cpp import Llama

    tokens = np.load(tokens_path)
    llm = Llama(
        model_path=gguf,
        n_ctx=tokens.shape[1] + new,
        n_batch=tokens.shape[1],
        logits_all=True,
        n_threads=2,
        verbose=False,
    )
    rows = []
    for row in tokens:
        llm.reset()
        llm.eval(row.tolist())
        rows.append(np.array(llm.scores[: len(row)], dtype=np.float32))
    llm.reset()
    llm.eval(tokens[0, :prompt_len].tolist())
    greedy = []
    for _ in range(new):  # argmax decoding on token ids: no sampler, no tokenizer round trip
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(nxt)
        llm.eval([nxt])
    np.savez(out, logits=np.stack(rows), greedy=np.array(greedy, dtype=np.int64))


def tokenize(gguf: str, texts_path: str) -> None:
    """Print llama.cpp's token ids of each text in TEXTS.json (no BOS; special tokens parsed)."""
    from llama_cpp import Llama

    llm = Llama(model_path=gguf, vocab_only=True, verbose=False)
    texts = json.loads(open(texts_path).read())
    print(json.dumps([llm.tokenize(t.encode(), add_bos=False, special=True) for t in texts]))


def quantize(src: str, dst: str, ftype: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    if mode == "logits":
        logits(args[0], args[1], args[2], *(int(a) for a in args[3:]))
    elif mode == "tokenize":
        tokenize(*args)
    elif mode == "quantize":
        quantize(*args)
    elif mode == "version":
        import llama_cpp

        print(json.dumps({"llama_cpp_python": llama_cpp.__version__}))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
