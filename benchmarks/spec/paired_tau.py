"""τ of two proposers measured on the same prompts, compared pairwise: the difference and its standard
error from one bootstrap over the prompts (fp8ptq.spec.acceptance.paired_tau_difference). Two heads whose τ
differ by less than either run's own s.e. can still be ranked when the paired error is small.

    fp8ptq spec measure TARGET A --num-prompts 32 --max-tokens 128 --gammas 4 --save a.json   # and B -> b.json
    .venv/bin/python benchmarks/spec/paired_tau.py a.json b.json [--gamma 4] [--temperature 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fp8ptq.spec.acceptance import paired_tau_difference, read_measurement


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    ms = [read_measurement(f) for f in (args.a, args.b)]
    if ms[0].prompt_ids != ms[1].prompt_ids:
        raise SystemExit("the two measurements ran on different prompts: a paired comparison needs the same ones")
    runs = [
        next(r for r in m.by_temperature[str(args.temperature)].runs if r.gamma == args.gamma and r.threshold is None)
        for m in ms
    ]
    diff, se = paired_tau_difference(*runs)
    a, b = runs
    print(f"τ A {a.tau:.3f} ± {a.tau_se:.3f}, B {b.tau:.3f} ± {b.tau_se:.3f}; B − A = {diff:+.3f} ± {se:.3f} (paired)")


if __name__ == "__main__":
    main()
