"""Each draft-training default is defined once, in its trainer's config: the commands pass only what the
user gave, and their help states the configs' values (so help and behaviour cannot disagree); README's
quantize option table names every option the command has, and no other."""

from __future__ import annotations

import dataclasses
import re

import typer.main

from fp8ptq.cli import app, options
from fp8ptq.cli.fielded import CHOICES_ATTR, fields_of, spelling_of
from fp8ptq.draft.auto import DraftBundleConfig
from fp8ptq.draft.eagle3_train import Eagle3TrainConfig
from fp8ptq.draft.train import DraftTrainConfig
from fp8ptq.fields import UNSET, default_of, help_of
from fp8ptq.recipe import Calibration
from fp8ptq.runs.config import QuantizeConfig, draft_bundle


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _help(command: str, option: str) -> str:
    cmd = typer.main.get_command(app).commands[command]
    return next(p.help for p in cmd.params if p.name == option)


def test_draft_defaults_live_in_the_trainer_configs_and_the_help_states_them():
    model, eagle3 = _defaults(DraftTrainConfig), _defaults(Eagle3TrainConfig)
    cmd = typer.main.get_command(app).commands["draft-train"]
    for option in ("max_steps", "lr"):  # the trainers disagree: the option defaults to the kind's
        stated = re.search(r"default ([\d.e-]+); eagle3 ([\d.e-]+)", _help("draft-train", option))
        assert tuple(map(float, stated.groups())) == (model[option], eagle3[option]), option
        assert next(p.default for p in cmd.params if p.name == option) is None
    assert model["batch_size"] == eagle3["batch_size"] == next(p.default for p in cmd.params if p.name == "batch_size")
    stated = re.search(r"(\d+); eagle3 (\d+)", _help("quantize", "draft_steps"))
    assert tuple(map(int, stated.groups())) == (model["max_steps"], eagle3["max_steps"])
    # quantize --draft leaves the step count to the trainer of the kind it trains; its settings are one
    # DraftBundleConfig, whose defaults are the command's
    assert QuantizeConfig(model="m", recipe="r", output="o").draft is None
    bundle, cmd = draft_bundle("auto"), typer.main.get_command(app).commands["quantize"]
    assert bundle == DraftBundleConfig(kind="model") and bundle.max_steps is None
    by_name = {p.name: p.default for p in cmd.params}
    assert by_name["draft_time_budget"] == bundle.time_budget_s and by_name["draft_steps"] is None


def _readme_table() -> list[str]:
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("| option | default | meaning |")
    return readme[start : readme.index(options.END, start)].splitlines()[2:]


def test_readme_option_table_is_rendered_from_the_command():
    """The table is what `python -m fp8ptq.cli.options --write` prints: names and defaults from the
    command, meanings from its help (+ the field's `more`)."""
    text = options.README.read_text()
    assert options.rendered(text) == text, "README's quantize table is stale: python -m fp8ptq.cli.options --write"


def commands(group=None, prefix=""):
    """(name, click command) of every command the CLI has, sub-apps included."""
    group = group or typer.main.get_command(app)
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from commands(cmd, f"{prefix}{name} ")
        else:
            yield prefix + name, cmd


def test_generated_options_show_their_fields_help_and_default():
    """Every option generated from a config field (cli/fielded.py) shows that field's help and starts at
    its default, on every command: help, behaviour and README cannot disagree."""
    checked = 0
    for name, cmd in commands():
        for p in cmd.params:
            where = fields_of(cmd.callback).get(p.name)
            if where is None or p.required:
                continue
            f = next(f for f in dataclasses.fields(where[0]) if f.name == where[1])
            cli = spelling_of(cmd.callback).get(p.name, f.metadata["cli"])
            assert p.help.startswith(cli.help or help_of(*where)), (name, p.name)
            default = cli.default if cli.default != UNSET else None if cli.parse else default_of(*where)
            choices = getattr(cmd.callback, CHOICES_ATTR, {}).values()
            if len({repr(default_of(c, p.name)) for c in choices if p.name in c.__dataclass_fields__}) > 1:
                default = None  # the configs disagree: the chosen kind's
            elif cli.negated:
                default = False
            elif p.multiple:
                default = list(default) if isinstance(default, tuple) else [default]
            assert p.default == default or p.name == "draft", (name, p.name)
            checked += 1
    assert checked >= 30
    cmd = typer.main.get_command(app).commands["quantize"]
    assert help_of(QuantizeConfig, "draft") == next(p.help for p in cmd.params if p.name == "draft")


def test_readme_option_table_names_every_quantize_option_and_no_other():
    rows = _readme_table()
    documented = {o for row in rows for o in re.findall(r"`(--[\w-]+)", row.split(" | ")[0])}
    cmd = typer.main.get_command(app).commands["quantize"]
    options_ = {o for p in cmd.params for o in p.opts if o.startswith("--")} - {"--help"}
    assert documented == options_, (sorted(options_ - documented), sorted(documented - options_))


def test_readme_option_table_states_the_commands_defaults():
    """Where README's quantize table gives a literal default (a number, `name`, off), it is the command's;
    a "recipe's (N)" default is the recipe schema's."""
    cmd = typer.main.get_command(app).commands["quantize"]
    by_opt = {o: p for p in cmd.params for o in p.opts}
    checked = 0
    for row in _readme_table():
        cells = row.split(" | ")
        opts, stated = re.findall(r"`(--[\w-]+)", cells[0]), cells[1].strip()
        if len(opts) != 1:
            continue
        default = by_opt[opts[0]].default
        recipe_default = re.fullmatch(r"recipe's \((\d+)\)", stated)
        if recipe_default and opts[0] != "--block-size":
            field = opts[0][2:].replace("-", "_")
            assert Calibration.model_fields[field].default == int(recipe_default.group(1)), opts
        elif stated == "off":
            assert default is False, opts
        elif re.fullmatch(r"`?[\w.-]+`?", stated) and stated not in ("main", "—"):
            literal = stated.strip("`")
            want = float(literal) if re.fullmatch(r"[\d.]+", literal) else literal
            got = default[0] if isinstance(default, (list, tuple)) and len(default) == 1 else default
            assert (float(got) if isinstance(want, float) else got) == want, (opts, stated, default)
        else:
            continue
        checked += 1
    assert checked >= 18  # the table's literal defaults are all compared, not skipped


def test_the_mmap_threshold_is_raised_only_where_the_recipe_trains_its_rounding():
    """1 MiB keeps the default command's peak RSS low; SignRound's steps get 8 MiB (1.9x faster), unless the
    user asked for low memory; a recipe that does not load leaves the error to the run."""
    from pathlib import Path

    from fp8ptq.cli.quantize import mmap_threshold_mib

    def mib(recipe, **kw):
        return mmap_threshold_mib(QuantizeConfig(model="m", recipe=recipe, output=Path("/nonexistent/o"), **kw))

    assert mib("w4a16-signround") == mib("nvfp4a16-signround") == mib("mxfp4a16-signround") == 8
    assert mib("fp8-kv8", sets=("calibration.rounding=signround",)) == 8
    assert mib("w4a16-signround", offload_activations=True) == 1
    assert mib("fp8-kv8") == mib("w4a16") == mib("no-such-recipe") == 1
