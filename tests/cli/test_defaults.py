"""Each draft-training default is defined once, in its trainer's config: the commands pass only what the
user gave, and their help states the configs' values (so help and behaviour cannot disagree); README's
quantize option table names every option the command has, and no other."""

from __future__ import annotations

import dataclasses
import re

import typer.main

from fp8ptq.cli import app
from fp8ptq.draft.auto import DraftBundleConfig
from fp8ptq.draft.eagle3_train import Eagle3TrainConfig
from fp8ptq.draft.train import DraftTrainConfig
from fp8ptq.runs.config import QuantizeConfig, draft_bundle


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _help(command: str, option: str) -> str:
    cmd = typer.main.get_command(app).commands[command]
    return next(p.help for p in cmd.params if p.name == option)


def test_draft_defaults_live_in_the_trainer_configs_and_the_help_states_them():
    model, eagle3 = _defaults(DraftTrainConfig), _defaults(Eagle3TrainConfig)
    for option, key in (("max_steps", "max_steps"), ("batch_size", "batch_size"), ("lr", "lr")):
        stated = re.search(r"default ([\d.e-]+); eagle3 ([\d.e-]+)", _help("draft-train", option))
        assert tuple(map(float, stated.groups())) == (model[key], eagle3[key]), option
    stated = re.search(r"(\d+); eagle3 (\d+)", _help("quantize", "draft_steps"))
    assert tuple(map(int, stated.groups())) == (model["max_steps"], eagle3["max_steps"])
    # quantize --draft leaves the step count to the trainer of the kind it trains; its settings are one
    # DraftBundleConfig, whose defaults are the command's
    assert QuantizeConfig(model="m", recipe="r", output="o").draft is None
    bundle, cmd = draft_bundle("auto"), typer.main.get_command(app).commands["quantize"]
    assert bundle == DraftBundleConfig(kind="model") and bundle.max_steps is None
    by_name = {p.name: p.default for p in cmd.params}
    assert by_name["draft_time_budget"] == bundle.time_budget_s and by_name["draft_steps"] is None


def test_readme_option_table_names_every_quantize_option_and_no_other():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("| option | default | meaning |")
    rows = readme[start:].split("\n\n")[0].splitlines()[2:]
    documented = {o for row in rows for o in re.findall(r"`(--[\w-]+)", row.split(" | ")[0])}
    cmd = typer.main.get_command(app).commands["quantize"]
    options = {o for p in cmd.params for o in p.opts if o.startswith("--")} - {"--help"}
    assert documented == options, (sorted(options - documented), sorted(documented - options))


def test_readme_option_table_states_the_commands_defaults():
    """Where README's quantize table gives a literal default (a number, `name`, off), it is the command's."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("| option | default | meaning |")
    rows = readme[start:].split("\n\n")[0].splitlines()[2:]
    cmd = typer.main.get_command(app).commands["quantize"]
    by_opt = {o: p for p in cmd.params for o in p.opts}
    checked = 0
    for row in rows:
        cells = row.split(" | ")
        opts, stated = re.findall(r"`(--[\w-]+)", cells[0]), cells[1].strip()
        if len(opts) != 1:
            continue
        default = by_opt[opts[0]].default
        if stated == "off":
            assert default is False, opts
        elif re.fullmatch(r"`?[\w.-]+`?", stated) and stated not in ("main", "—"):
            literal = stated.strip("`")
            want = float(literal) if re.fullmatch(r"[\d.]+", literal) else literal
            got = default[0] if isinstance(default, (list, tuple)) and len(default) == 1 else default
            assert (float(got) if isinstance(want, float) else got) == want, (opts, stated, default)
        else:
            continue
        checked += 1
    assert checked >= 15  # the table's literal defaults are all compared, not skipped
