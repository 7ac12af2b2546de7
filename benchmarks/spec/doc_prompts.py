"""Write a prompts file (.jsonl, field "text") for draft training: instruction prompts over the docstrings
of Python's own standard library, plus the built-in calibration-split prompts.

The built-in prompt set (fp8ptq.spec.prompts) draws its calibration split from ~70 pydoc topics, so 1 000
prompts repeat each topic ~15 times; the docstrings of the stdlib's modules, classes and functions are the
same kind of text (Python documentation) from a few thousand distinct sources. The measurement prompts
(the evaluation split of the pydoc topics) are not in either.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/spec/doc_prompts.py -o prompts.jsonl --num 2048 --builtin 256
    fp8ptq draft-train TARGET --kind eagle3 --prompts prompts.jsonl --num-prompts 2304 ...
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import sys
import warnings

from fp8ptq.spec.prompts import _TEMPLATES, _snippet, builtin_prompts

SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "pydoc_data", "lib2to3", "ensurepip"}
SKIP |= {"venv", "msvcrt", "winreg", "winsound", "nt", "curses", "readline", "test", "ctypes", "sqlite3"}


def docstrings(min_chars: int) -> list[str]:
    out, seen = [], set()
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - platform modules that do not import here are skipped
            continue
        objs = [mod]
        for k, v in sorted(vars(mod).items()):
            if k.startswith("_") or not callable(v) or not str(getattr(v, "__module__", "")).startswith(name):
                continue
            objs.append(v)
            if inspect.isclass(v):  # and the class's own public methods
                objs += [m for n, m in sorted(vars(v).items()) if not n.startswith("_") and callable(m)]
        for obj in objs:
            doc = inspect.getdoc(obj) or ""
            if len(doc) >= min_chars and doc not in seen:
                seen.add(doc)
                out.append(doc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--num", type=int, default=2048, help="docstring prompts")
    ap.add_argument("--builtin", type=int, default=256, help="built-in calibration-split prompts added")
    ap.add_argument("--min-chars", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    docs = docstrings(a.min_chars)
    rng = random.Random(a.seed)
    rng.shuffle(docs)
    prompts = [rng.choice(_TEMPLATES).format(_snippet(d, 400)) for d in docs[: a.num]]
    prompts += builtin_prompts("calibration", a.builtin, a.seed) if a.builtin else []
    rng.shuffle(prompts)
    with open(a.output, "w", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps({"text": p}) + "\n")
    print(f"{len(docs)} distinct docstrings >= {a.min_chars} chars; wrote {len(prompts)} prompts to {a.output}")


if __name__ == "__main__":
    main()
