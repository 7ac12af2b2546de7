"""An EAGLE-3 work dir whose last aux layer is the target's final residual stream (aux id L) instead of the
one captured (default L - 3), made from an existing capture without running the target again (issue 20:
which target layers the head should read).

draft-train's capture also records `final`, the target's residual stream after its last layer over its
RMS (the linear warm start's target). With `fc_norm` (fp8ptq's default) each aux chunk is RMS-normalised
before fc, so that chunk is exactly what vLLM would feed for aux id L (vLLM 0.32 records id idx + 1 after
decoder layer idx: `_maybe_add_hidden_state` in llama.py), up to bf16 rounding of the stored values.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/spec/eagle3_last_layer.py SRC_OUT DST_OUT
    fp8ptq draft-train TARGET -o DST_OUT --kind eagle3 --layer-ids 2,15,30 ...  # the same data flags as SRC

SRC_OUT / DST_OUT are draft-train output paths; their work dirs are .NAME.draft-work beside them (SRC's
kept with --keep-work). Shards are rewritten (aux's last chunk replaced); data.safetensors is linked.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from fp8ptq.draft.train import work_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    a = ap.parse_args()
    src, dst = work_dir(Path(a.src)), work_dir(Path(a.dst))
    dst.mkdir(parents=True, exist_ok=False)
    fp = json.loads((src / "eagle3.json").read_text())
    ids = json.loads(fp["layer_ids"])
    shards = sorted(src.glob("shard-*.safetensors"))
    for f in shards:
        t = load_file(str(f))
        H = t["final"].shape[-1]
        assert t["aux"].shape[-1] == len(ids) * H
        t["aux"] = torch.cat([t["aux"][..., :-H], t["final"].to(t["aux"].dtype)], -1).contiguous()
        save_file(t, str(dst / f.name))
    os.link(src / "data.safetensors", dst / "data.safetensors")
    n_layers = int(json.loads((Path(fp["target"]) / "config.json").read_text())["num_hidden_layers"])
    fp["layer_ids"] = str(ids[:-1] + [n_layers])
    (dst / "eagle3.json").write_text(json.dumps(fp))
    print(f"{len(shards)} shards: aux layers {ids} -> {ids[:-1] + [n_layers]} in {dst}")


if __name__ == "__main__":
    main()
