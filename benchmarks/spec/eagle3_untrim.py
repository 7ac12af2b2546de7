"""The full-vocabulary twin of a trimmed EAGLE-3 head, for measuring what the trim costs in τ at
identical training (issue 20): the same fc / decoder layer / norm, and an LM head over the target's
whole vocabulary whose rows for the kept ids are the trimmed head's trained rows and whose other rows
are the target's own LM-head rows (what draft-train starts every row from). No d2t / t2d.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/spec/eagle3_untrim.py TARGET TRIMMED_HEAD -o FULL_HEAD

Training a full-vocabulary head directly is the other comparison; on the 2-core CPU its LM head (49152
rows) made a training step ~4.5x slower than the 8192-row head's (BENCHMARKS.md), too slow to repeat
the trimmed head's 240 steps in one session.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from fp8ptq.io import atomic_output_dir
from fp8ptq.spec.eagle3 import build_head, export_config, export_state, load_head
from fp8ptq.spec.models import load_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("target")
    ap.add_argument("trimmed")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()
    target, src = load_target(args.target)
    small = load_head(args.trimmed, target.model)
    V = int(target.model.config.vocab_size)
    full = build_head(target.model, list(small.s.layer_ids), V, small.s.fc_norm)  # LM head = the target's rows
    with torch.no_grad():
        mine = dict(full.named_parameters())
        for name, p in small.named_parameters():
            if name != "lm_head.weight":
                mine[name].copy_(p)
        kept = torch.arange(small.s.draft_vocab) + small.d2t  # draft row i predicts target id i + d2t[i]
        full.lm_head.weight[kept] = small.lm_head.weight
    tcfg = json.loads((Path(src.path) / "config.json").read_text())
    with atomic_output_dir(args.output, overwrite=True) as tmp:
        save_file(export_state(full), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(export_config(tcfg, full.s), indent=2) + "\n")
    print(f"{args.output}: {small.s.draft_vocab} trained rows of {V}")


if __name__ == "__main__":
    main()
