"""conversion/registry.py: one entry per (source, target) is what `convert` accepts, what its help offers
and what detection may name; a pair without a converter is refused before any output, naming the ones
that exist."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fp8ptq.api import ConvertConfig, convert
from fp8ptq.cli import app
from fp8ptq.conversion.registry import CONVERTERS, SOURCES, TARGETS, ConverterModule, find
from fp8ptq.errors import ModelError, OptionError

pytestmark = pytest.mark.tiny


def _dir(tmp_path, name: str, method: str | None, **extra):
    d = tmp_path / name
    d.mkdir()
    config = {"model_type": "llama"}
    if method is not None:
        config["quantization_config"] = {"quant_method": method, **extra}
    (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("conv", CONVERTERS, ids=lambda c: f"{c.source}->{c.target}")
def test_each_converter_module_has_the_three_functions(conv):
    """The declared ConverterModule protocol, its arities included (the protocol checks names only)."""
    module = conv.functions()
    assert isinstance(module, ConverterModule)
    for name, params in (("check", 2), ("write", 4), ("describe", 1)):
        fn = getattr(module, name, None)
        assert callable(fn), f"fp8ptq.conversion.{conv.module} has no {name}()"
        assert len(inspect.signature(fn).parameters) == params, (conv.module, name)


def test_pairs_are_unique_and_detection_names_only_what_is_read(tmp_path):
    pairs = [(c.source, c.target) for c in CONVERTERS]
    assert len(pairs) == len(set(pairs))
    assert set(TARGETS) == {"hf", "compressed-tensors", "gguf"}
    from fp8ptq.conversion.detect import format_of_config

    detected = set()
    for m in ("gptq", "awq", "modelopt", "compressed-tensors", "fp8", None):
        d = _dir(tmp_path, str(m), m, **({"weight_block_size": [128, 128]} if m == "fp8" else {}))
        detected.add(format_of_config(d, json.loads((d / "config.json").read_text())))
    assert detected | {"gguf"} == set(SOURCES)  # a float checkpoint is read too (--to gguf)


def test_a_pair_without_a_converter_names_the_ones_there_are(tmp_path):
    ct = _dir(tmp_path, "ct", "compressed-tensors")
    with pytest.raises(ModelError, match="writes gguf from it, not compressed-tensors") as err:
        find(ConvertConfig(source=ct, output=tmp_path / "o", to="compressed-tensors"))
    assert "that format already" in err.value.fix
    gptq = _dir(tmp_path, "gptq", "gptq")
    with pytest.raises(ModelError, match="writes compressed-tensors from it, not hf"):
        convert(ConvertConfig(source=gptq, output=tmp_path / "o", to="hf"))
    with pytest.raises(ModelError, match="--recipe applies to GGUF sources only, not gptq"):
        convert(ConvertConfig(source=gptq, output=tmp_path / "o", to="compressed-tensors", recipe="fp8-dynamic"))
    with pytest.raises(OptionError, match="unknown --from 'exl2'.*"):
        find(ConvertConfig(source=gptq, output=tmp_path / "o", to="hf", source_format="exl2"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct", "gptq"]  # nothing written


def test_help_offers_every_source_and_target_and_the_registry_imports_no_torch():
    out = CliRunner().invoke(app, ["convert", "--help"], env={"COLUMNS": "200"}).output
    for fmt in (*SOURCES, *TARGETS):
        assert fmt in out, fmt
    code = "import sys, fp8ptq.conversion.registry; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_module_without_the_protocol_is_refused():
    from fp8ptq.conversion.registry import Converter

    with pytest.raises(TypeError, match="lacks check / write / describe"):
        Converter("x", "y", "registry", "nothing").functions()  # the registry module itself converts nothing
