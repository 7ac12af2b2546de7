"""The quality check's cost split into its decoder layers and its LM heads (eval/stream.compare_streaming):

    .venv/bin/python benchmarks/speed/eval_head.py REFERENCE CHECKPOINT [SAMPLES]

REFERENCE: the float model (alias, .gguf, directory); CHECKPOINT: an export of it. Prints the metrics to
9 digits (a change of the evaluator must leave them equal) and the seconds in the layers and the heads.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fp8ptq.data import load_samples
from fp8ptq.eval.stream import compare_streaming
from fp8ptq.models.loader import open_hf_dir, resolve_model


def main() -> None:
    ref, cand = resolve_model(sys.argv[1]), open_hf_dir(Path(sys.argv[2]))
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    ids = load_samples("builtin", ref.tokenizer(), n, 512, "evaluation", 0)
    marks: list[tuple[str, float]] = []
    t = time.perf_counter()
    metrics, _ = compare_streaming(
        ref, cand, ids, simulate_reference=True, progress=lambda stage, *_: marks.append((stage, time.perf_counter()))
    )
    total = time.perf_counter() - t
    layers = max(m for stage, m in marks if stage == "evaluate") - t
    print({k: f"{v:.9g}" if isinstance(v, float) else v for k, v in metrics.items()})
    print(f"total {total:.1f} s, layers {layers:.1f} s, heads {total - layers:.1f} s")


if __name__ == "__main__":
    main()
