"""fp8ptq/results.py: typed results become JSON with schema keys and come back only through validation."""

from __future__ import annotations

import json

import pytest

from fp8ptq.conversion.inspect import Finding, InspectReport
from fp8ptq.errors import ModelError, OptionError
from fp8ptq.results import from_json, read_json, to_json

REPORT = InspectReport(
    path="m",
    format="compressed-tensors",
    size_bytes=10,
    bits_per_param=4.5,
    findings=(Finding("error", "missing-tensors", "a.b", "needs weight_scale"), Finding("info", "x", "c", "d")),
    schemes={"INT4 per-group g32": 14},
    linears=15,
    linears_unquantized=1,
)


def test_round_trip_through_a_file(tmp_path):
    data = to_json(REPORT)
    assert list(data)[:2] == ["schema", "schema_version"] and data["errors"] == 1
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    back = read_json(path, InspectReport)
    assert back == REPORT and isinstance(back.findings[0], Finding) and back.errors == 1


def test_a_file_from_before_the_schema_keys_reads_as_version_1():
    data = to_json(REPORT)
    del data["schema"], data["schema_version"]
    assert from_json(data, InspectReport, where="old.json") == REPORT


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.pop("format"), r"'f.json' is not a valid 'inspect' file: format: Field required"),
        (lambda d: d.update(size_bytes="big"), r"size_bytes: Input should be a valid integer"),
        (lambda d: d["findings"][0].pop("code"), r"findings\.0\.code: Field required"),
        (lambda d: d.update(schema="measure"), r"'f.json' holds schema 'measure', not 'inspect'"),
        (lambda d: d.update(schema_version=2), r"schema_version 2; this fp8ptq reads up to 1"),
    ],
)
def test_a_bad_file_is_a_typed_error_naming_the_file_and_field(edit, message):
    data = json.loads(json.dumps(to_json(REPORT)))
    edit(data)
    with pytest.raises(ModelError, match=message):
        from_json(data, InspectReport, where="f.json")


def test_unreadable_files_and_the_callers_error_type(tmp_path):
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(OptionError, match="holds a JSON list, not fp8ptq's 'inspect' object") as err:
        read_json(tmp_path / "x.json", InspectReport, error=OptionError, fix="pass the file inspect --json wrote")
    assert err.value.fix == "pass the file inspect --json wrote"
    (tmp_path / "y.json").write_text("{")
    with pytest.raises(ModelError, match="cannot read"):
        read_json(tmp_path / "y.json", InspectReport)
    with pytest.raises(ModelError, match="cannot read"):
        read_json(tmp_path / "missing.json", InspectReport)
