"""sha256 of every file every built-in recipe writes on smollm2-135m: the byte-identity check for
refactors ("outputs unchanged"). Run it on the base commit and on the change, on the same machine (CPU
flags change float results), and compare:

    python benchmarks/output_hashes.py --out before.json              # on the base commit
    python benchmarks/output_hashes.py --out after.json --compare before.json

Only the run's wall-clock timings are taken out before hashing (the manifest's `timings` and the one
line of the reports and the model card that prints them); everything else — tensors, config, manifest numbers, report
text, plots — is hashed as written. Tensors are hashed one by one (`tensor:NAME`: dtype, shape and bytes),
whatever shard holds them, so a change of sharding alone compares equal; the index, which only says
where each tensor lies, is left out. `--model` runs the recipes on another model (a .gguf, a directory). Calibration is reduced (16 x 256 tokens, 2 evaluation samples) so
the whole set runs in minutes; every code path of every recipe still runs, the quality check included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# SmolLM2's widths (576) are not whole 128-blocks / 128-groups: the sizes its CI runs use (tests/conftest.py)
EXTRA = {"fp8-block": ["--block-size", "64"], "w4a8-fp8": ["--group-size", "64"]}
VOLATILE_LINE = re.compile(rb"^(timings?:|Timings:).*$", re.MULTILINE | re.IGNORECASE)


def builtin_recipes() -> list[str]:
    return sorted(p.stem for p in (REPO / "fp8ptq" / "recipes").glob("*.yaml"))


def file_hash(path: Path) -> str:
    data = path.read_bytes()
    if path.name == "fp8ptq_manifest.json":
        manifest = json.loads(data)
        manifest.pop("timings", None)
        data = json.dumps(manifest, indent=2, sort_keys=True).encode()
    elif path.name in ("report.md", "report.html", "README.md"):  # the model card carries report.md's body
        data = VOLATILE_LINE.sub(b"", data)
    return hashlib.sha256(data).hexdigest()


def tensor_hashes(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as h:
        for name in h.keys():
            t = h.get_tensor(name)
            data = t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
            head = f"{t.dtype}:{list(t.shape)}:".encode()
            out[f"tensor:{name}"] = hashlib.sha256(head + data).hexdigest()
    return out


def output_hashes(out: Path) -> dict[str, str]:
    hashes: dict[str, str] = {}
    for p in sorted(out.rglob("*")):
        if not p.is_file() or p.name == "model.safetensors.index.json":
            continue
        if p.suffix == ".safetensors":
            hashes.update(tensor_hashes(p))
        else:
            hashes[str(p.relative_to(out))] = file_hash(p)
    return hashes


def run_recipe(recipe: str, out: Path, extra: list[str], model: str = "smollm2-135m") -> dict[str, str]:
    cmd = [
        sys.executable,
        "-m",
        "fp8ptq",
        "quantize",
        model,
        "-r",
        recipe,
        "-o",
        str(out),
        "--num-samples",
        "16",
        "--seq-len",
        "256",
        "--eval-samples",
        "2",
        "--json",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:  # recorded, and the run goes on: one refusal must not cost the others' hashes
        return {"FAILED": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    return output_hashes(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file: recipe -> file -> sha256")
    ap.add_argument("--compare", type=Path, help="an earlier --out file: report identical / different files")
    ap.add_argument("--recipes", default=",".join(builtin_recipes()), help="comma-separated (default: all built-in)")
    ap.add_argument("--model", default="smollm2-135m", help="the model every recipe runs on (default: the demo)")
    args = ap.parse_args()
    hashes = {}
    # A fixed output path: the reports print the folder name and the serve commands print its path.
    root = Path(tempfile.gettempdir()) / "fp8ptq-output-hashes"
    for recipe in args.recipes.split(","):
        out = root / recipe
        hashes[recipe] = run_recipe(recipe, out, ["--overwrite", *EXTRA.get(recipe, [])], args.model)
        failed = hashes[recipe].get("FAILED")
        print(f"{recipe}: " + (f"FAILED {failed}" if failed else f"{len(hashes[recipe])} files"), flush=True)
    args.out.write_text(json.dumps(hashes, indent=2, sort_keys=True) + "\n")
    if any("FAILED" in files for files in hashes.values()):
        sys.exit(2)
    if args.compare:
        before = json.loads(args.compare.read_text())
        same = differ = 0
        for recipe, files in hashes.items():
            old = before.get(recipe, {})
            for name in sorted(set(files) | set(old)):
                if files.get(name) == old.get(name):
                    same += 1
                else:
                    differ += 1
                    was, now = old.get(name, "missing")[:12], files.get(name, "missing")[:12]
                    print(f"DIFFERENT {recipe}/{name}: {was} -> {now}")
        print(f"{same} files identical, {differ} different")
        sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
