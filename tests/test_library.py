"""The Python API (fp8ptq/library.py): `import fp8ptq` stays light; `fp8ptq.quantize` on a model held in
memory, with a recipe edited in Python, writes what the CLI writes for the same model, recipe and data, and
leaves the model as it was (examples/python_api.py, the script README shows)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp8ptq.errors import OptionError

from helpers import QUICK, run_cli

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "python_api.py"


def _example():
    spec = importlib.util.spec_from_file_location("python_api", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _state_hash(model) -> str:
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensors(out: Path) -> dict[str, bytes]:
    found = {}
    for f in sorted(out.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                found[k] = (str(t.dtype), tuple(t.shape), t.contiguous().view(torch.uint8).numpy().tobytes())
    return found


def _same_export(a: Path, b: Path) -> None:
    assert _tensors(a) == _tensors(b)
    for name in ("config.json", "recipe.yaml", "tokenizer.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_import_fp8ptq_is_light_and_names_the_api():
    code = (
        "import sys, fp8ptq; assert 'torch' not in sys.modules, 'torch imported'; "
        "print(fp8ptq.quantize, fp8ptq.Recipe, fp8ptq.model_free, fp8ptq.convert)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and "function quantize" in r.stdout and "class 'fp8ptq.recipe.Recipe'" in r.stdout, r


@pytest.mark.tiny
def test_a_model_in_memory_exports_what_the_cli_exports(tiny_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fp8ptq

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype="auto")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    before = _state_hash(model)
    recipe = {**fp8ptq.Recipe.builtin("fp8-kv8").model_dump(mode="json"), "description": "edited"}  # a mapping
    opts = dict(num_samples=2, seq_len=32, eval_samples=0, recipe_gates=False, weights="rtn")
    result = fp8ptq.quantize(model, recipe, tmp_path / "api", tokenizer=tokenizer, **opts)
    assert _state_hash(model) == before and result.passed and result.output == tmp_path / "api"
    assert result.manifest.model == str(tiny_dir)  # the label: where transformers loaded it from
    (tmp_path / "edited.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    rc, output = run_cli("quantize", tiny_dir, "-r", tmp_path / "edited.yaml", "-o", tmp_path / "cli", *QUICK)
    assert rc == 0, output
    _same_export(tmp_path / "api", tmp_path / "cli")
    with pytest.raises(OptionError, match="needs its tokenizer"):
        fp8ptq.quantize(model, "fp8-kv8", tmp_path / "x")
    with pytest.raises(OptionError, match="unknown option 'num_sample'"):
        fp8ptq.quantize(model, "fp8-kv8", tmp_path / "x", tokenizer=tokenizer, num_sample=2)
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_the_example_on_the_demo_model_matches_the_cli(smol_dir, tmp_path):
    """examples/python_api.py: SmolLM2 loaded by transformers, w8a8-int8 edited in Python, calibrated in
    memory; the same export as the command line's on its folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    example = _example()
    model = AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype="auto")
    before = _state_hash(model)
    result = example.quantize_in_memory(model, AutoTokenizer.from_pretrained(str(smol_dir)), str(tmp_path / "api"))
    assert _state_hash(model) == before and result.manifest.quality is not None
    rc, output = run_cli("quantize", smol_dir, *example.CLI_ARGS, "-o", tmp_path / "cli")
    assert rc in (0, 3), output  # gates are not the point here: 4 x 128 calibration
    _same_export(tmp_path / "api", tmp_path / "cli")
