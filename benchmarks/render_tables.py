"""Render BENCHMARKS.md's tables from the benchmark scripts' JSON (issue 34: the results page is built,
not typed). Each rendered table sits between `<!-- rendered: NAME JSON -->` and `<!-- end rendered -->`;
tests/benchmarks/test_render_tables.py holds the page to what this prints.

    python benchmarks/render_tables.py recipes benchmarks/results/recipes.json   # print the table
    python benchmarks/render_tables.py --write BENCHMARKS.md                      # refresh every table
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- rendered: (\S+) (\S+) -->\n)(.*?)(<!-- end rendered -->)", re.S)


def _machine(m: dict) -> str:
    flags = " + ".join(f for f, on in (("AVX-512", m.get("avx512")), ("VNNI", m.get("vnni"))) if on)
    return f"{m.get('cpus')}-core {m.get('processor')}" + (f", {flags}" if flags else ", AVX2 only")


MODEL_NAMES = {"smollm2-135m": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}


def recipes(data: dict) -> str:
    """`make bench` (benchmarks/quality/recipes_bench.py): one row per recipe, both real models side by side
    (KL, top-1, stored bits per quantized weight, wall time), the gates and whether they passed on each."""
    flag = re.compile(r" (--(?:block|group)-size \d+)")
    models = list(dict.fromkeys(r.get("model", "smollm2-135m") for r in data["recipes"]))
    head = "| recipe | " + " | ".join(f"{MODEL_NAMES.get(m, m)} KL / top-1 / bits / s" for m in models)
    head += " | gates | passed | commit |\n|---|" + "---|" * len(models) + "---|---|---|\n"
    by_recipe: dict[str, dict[str, dict]] = {}
    for r in data["recipes"]:
        by_recipe.setdefault(r["recipe"], {})[r.get("model", "smollm2-135m")] = r
    rows = []
    for name, runs in by_recipe.items():
        flags = sorted({f.group(1) for r in runs.values() if (f := flag.search(r["command"]))})
        cells = [name + "".join(f" (`{f}` on SmolLM2)" for f in flags)]
        for m in models:
            r = runs.get(m)
            if r is None or r.get("quality") is None:
                cells.append("—" if r is None else f"failed (exit {r['exit']})")
                continue
            q, bits = r["quality"], r.get("weight_bits")
            bits = "—" if bits is None else f"{bits:.2f}"
            cells.append(f"{q['kl']:.4f} / {q['top1']:.3f} / {bits} / {r['wall_s']:.0f}")
        first = next(iter(runs.values()))
        cells.append(", ".join(g["gate"] for g in first.get("gates") or []))
        cells.append(" / ".join("yes" if runs[m]["passed"] else "**no**" for m in models if m in runs))
        cells.append(", ".join(dict.fromkeys(r.get("commit", data["commit"]) for r in runs.values())))
        rows.append("| " + " | ".join(cells) + " |\n")
    foot = f"\nFile: {data['commit']}, {data['date']}, {_machine(data['machine'])}, {data['calibration']}.\n"
    return head + "".join(rows) + foot


def ci_suite(data: dict) -> str:
    """The suite's time per stop (benchmarks/results/ci-suite.json): the newest first, a measured row
    from a fresh clone beside the landing CI's reported time."""

    def cell(r: dict, key: str) -> str:
        v, note = r.get(key), r.get("notes", {}).get(key)
        return "—" if v is None else f"{v}" + (f" {note}" if note else "")

    head = "| stop | wall s | pytest s | tests | CI s | machine | commit | cmd | |\n"
    head += "|---|---:|---:|---|---:|---|---|---|---|\n"
    rows = []
    for r in data["rows"]:
        cells = [r["stop"], cell(r, "wall_s"), cell(r, "pytest_s"), r["tests"] or "—", cell(r, "ci_s")]
        cells += [r["machine"], r["commit"], r["cmd"] or "—", f"[§]({r['link']})" if r["link"] else "—"]
        rows.append("| " + " | ".join(cells) + " |\n")
    return head + "".join(rows)


# The GGUF table's rows: a label and the export(s) of benchmarks/results/llamacpp.json it shows; a row of two
# exports shows "first / second" in each cell (the llama.cpp gap: mean |Δlog p| only).
GGUF_ROWS = (
    ("fp8ptq `--gguf-type Q4_K_M`", ("fp8ptq Q4_K_M",)),
    ("fp8ptq `--gguf-type Q4_K_M --importance builtin` (32×512 calibration)", ("fp8ptq Q4_K_M --importance builtin",)),
    ("llama.cpp `llama_model_quantize` Q4_K_M (no imatrix)", ("llama.cpp Q4_K_M",)),
    ("fp8ptq `--gguf-type Q4_0` / llama.cpp Q4_0", ("fp8ptq Q4_0", "llama.cpp Q4_0")),
    ("fp8ptq Q6_K / Q8_0", ("fp8ptq Q6_K", "fp8ptq Q8_0")),
    ("F32 (control)", ("F32 (control: llama.cpp's own numerics)",)),
)


def llamacpp(data: dict) -> str:
    """fp8ptq's GGUF exports scored by llama.cpp (benchmarks/engines/llamacpp_check.py): size, the
    quantization's KL, and how far llama.cpp's log-probs are from fp8ptq's simulation of the same file."""

    def kl(v: float) -> str:
        return "0" if v == 0 else f"{v:.4f}" if v < 0.1 else f"{v:.3f}"

    def dlogp(v: float) -> str:
        return f"{v:.4f}" if v < 0.01 else f"{v:.3f}"

    def both(values: list[str]) -> str:
        return " / ".join(dict.fromkeys(values))  # equal values shown once

    head = "| GGUF (same model) | MiB | KL | llama.cpp gap: mean \\|Δlog p\\| / KL / top-1 | commit | machine | |\n"
    head += "|---|---:|---:|---|---|---|---|\n"
    rows = []
    for label, names in GGUF_ROWS:
        ex = [data["exports"][n] for n in names]
        gap = [dlogp(e["engine_dlogp"]) for e in ex]
        if len(ex) == 1:
            gap += [f"{ex[0]['engine_kl']:.4f}", f"{ex[0]['engine_top1']:.3f}"]
        cells = [label, both([f"{e['mb']:.1f}" for e in ex]), both([kl(e["quant_kl"]) for e in ex]), " / ".join(gap)]
        cells += [ex[0].get("commit", data["commit"]), data["machine"], f"[§]({data['link']})" if data["link"] else "—"]
        rows.append("| " + " | ".join(cells) + " |\n")
    run = f"{data['rows']}×{data['seq']} held-out tokens, llama-cpp-python {data['version']['llama_cpp_python']}"
    return head + "".join(rows) + f"\nCommand: `{data['command']}`; {run}.\n"


RENDERERS = {"recipes": recipes, "ci-suite": ci_suite, "llamacpp": llamacpp}


def render_page(text: str, root: Path = REPO) -> str:
    """The page with every rendered block replaced by what its renderer prints from its JSON."""

    def fill(m: re.Match) -> str:
        data = json.loads((root / m.group(3)).read_text())
        return m.group(1) + RENDERERS[m.group(2)](data) + m.group(5)

    return BLOCK.sub(fill, text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table", nargs="?", choices=sorted(RENDERERS))
    ap.add_argument("json", nargs="?", type=Path)
    ap.add_argument("--write", type=Path, help="a page (BENCHMARKS.md): refresh its rendered tables in place")
    args = ap.parse_args()
    if args.write:
        args.write.write_text(render_page(args.write.read_text()))
    else:
        print(RENDERERS[args.table](json.loads(args.json.read_text())), end="")


if __name__ == "__main__":
    main()
