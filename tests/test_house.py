"""The house rules, checked on the source tree (docs/DESIGN.md, "Layers"):

- imports flow one way: a module imports only packages of its own layer or below (function-level
  imports count too);
- files stay at most 400 lines, functions outside cli/ at most 80;
- no function outside the typer commands takes more than 6 positional parameters (use keywords);
- every repository path the docs, BENCHMARKS.md and the sources name exists;
- no module imports another module's private (`_name`) functions: what is shared is public;
- no compressed-tensors format name outside ops/ and quantization/schemes/: its scheme handler says what it means;
- one speculative loop verifies drafts (spec/measure.py), whatever the proposer;
- no command lists an option as a parameter and again to build its config (cli/fielded.py generates them);
- no issue or stop numbers in the sources and recipes (they belong in BENCHMARKS.md and the notebook).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp8ptq"

# Lowest first. A module may import fp8ptq packages of its own layer or a lower one, never a higher one.
LAYERS: list[tuple[str, ...]] = [
    ("fp8ptq", "errors", "fields", "io", "ops", "results"),  # the floor: math, typed errors/results/fields, I/O
    ("dist", "data", "gates", "models"),  # processes, text, gate syntax, model intake + architecture adapters
    ("quantization", "outliers", "manifest"),  # scheme handlers and numerics, statistics, the run record
    ("recipe", "recipe_files", "calibrate"),  # user configuration; the sequential pipeline
    ("export", "engine"),  # checkpoint writing; real engines out of process
    ("eval", "conversion"),  # simulated and engine-checked quality; checkpoint conversion and inspection
    ("spec",),  # speculative decoding with a draft
    ("draft",),  # making a draft (training, trimming, the quantize --draft bundle); spec never imports it
    ("report", "runs"),  # rendering; the steps of a quantize run
    ("api", "library"),  # the library's entry points
    ("cli", "__main__"),  # the command line
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
MAX_LINES = 400
MAX_POSITIONAL = 6


def _unit(module: str) -> str:
    """'fp8ptq.calibrate.pipeline' -> 'calibrate'; 'fp8ptq' -> 'fp8ptq'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "fp8ptq"]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "fp8ptq"
        ):
            if node.module == "fp8ptq":  # from fp8ptq import data -> the submodule
                out += [(node.lineno, f"fp8ptq.{a.name}") for a in node.names]
            else:
                out.append((node.lineno, node.module))
    return out


def layer_violations(root: Path) -> list[str]:
    """Upward imports (and modules of no declared layer) under `root` (a copy of the fp8ptq package)."""
    bad = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root.parent).with_suffix("")
        me = _unit(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
        if me not in LEVEL:
            bad.append(f"{rel}: '{me}' is in no layer of tests/test_house.py")
            continue
        for line, target in _imports(ast.parse(f.read_text())):
            them = _unit(target)
            if them not in LEVEL:
                bad.append(f"{rel}:{line} imports {target}, which is in no layer")
            elif LEVEL[them] > LEVEL[me]:
                bad.append(f"{rel}:{line} imports {target} (layer {LEVEL[them]}) from layer {LEVEL[me]}")
    return bad


def test_imports_flow_one_way():
    assert layer_violations(PACKAGE) == []


def test_a_planted_upward_import_is_caught(tmp_path):
    import shutil

    copy = tmp_path / "fp8ptq"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert layer_violations(copy) == []
    (copy / "ops" / "planted.py").write_text("def f():\n    from fp8ptq.cli import app  # ops must not know the CLI\n")
    found = layer_violations(copy)
    assert found == ["fp8ptq/ops/planted:2 imports fp8ptq.cli (layer 10) from layer 0"], found


def import_cycles(root: Path) -> list[list[str]]:
    """Cycles of imports (function-level ones included: they hide a cycle, they do not remove it) among the
    modules under `root` (a copy of the fp8ptq package). A package's `__init__` importing its own
    submodules (a registry: models/arch/) is not an edge; everything else is."""
    mods = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root.parent).with_suffix("").parts
        mods[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = f
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for me, f in mods.items():
        is_pkg = f.name == "__init__.py"
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in mods:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                if t in mods and t != me and not (is_pkg and t.startswith(me + ".")):
                    graph[me].add(t)
    cycles, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                cycle = path[path.index(nxt) :]
                if frozenset(cycle) not in done:
                    done.add(frozenset(cycle))
                    cycles.append(cycle + [nxt])
            elif nxt not in seen:
                seen.add(nxt)
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        seen = {start}
        walk(start, [start])
    return cycles


def test_no_import_cycles():
    """The layer order inside packages too: modules import each other one way (spec/ once hid a cycle
    behind function-level imports; models/ had loader -> gguf -> skeleton -> loader)."""
    assert import_cycles(PACKAGE) == []


def test_a_planted_cycle_is_caught(tmp_path):
    import shutil

    copy = tmp_path / "fp8ptq"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "spec" / "steps.py").write_text(
        (copy / "spec" / "steps.py").read_text() + "\n\ndef f():\n    from fp8ptq.spec.measure import measure_costs\n"
    )
    found = import_cycles(copy)
    assert found and all({"fp8ptq.spec.steps", "fp8ptq.spec.measure"} <= set(c) for c in found), found


def test_files_stay_small():
    long = {
        str(f.relative_to(PACKAGE)): n
        for f in PACKAGE.rglob("*.py")
        if (n := len(f.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"files over {MAX_LINES} lines: {long}"


def _is_command(fn: ast.AST) -> bool:
    """A typer command: decorated with `<app>.command(...)`."""
    return any(
        isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "command"
        for d in fn.decorator_list
    )


def _is_kernel(fn: ast.AST) -> bool:
    """A Triton kernel (`@triton.jit`): its parameters are the launch ABI, positional by nature."""
    return any(isinstance(d, ast.Attribute) and d.attr == "jit" for d in fn.decorator_list)


def _positional(fn: ast.FunctionDef) -> int:
    names = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    return len([n for n in names if n not in ("self", "cls")])


@pytest.mark.parametrize("path", sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")))
def test_few_positional_parameters(path):
    tree = ast.parse((PACKAGE / path).read_text())
    wide = [
        f"{n.name} ({_positional(n)})"
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and not _is_command(n)
        and not _is_kernel(n)
        and _positional(n) > MAX_POSITIONAL
    ]
    assert wide == [], f"{path}: more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only)"


MAX_PARAMETERS = 8
# Functions still wider than MAX_PARAMETERS, each a config object to come; the list only shrinks: a
# function that gets its config object must leave it (the test fails on a stale entry). Empty since stop 48.
WIDE_DEBT: dict[str, set[str]] = {}


def _parameters(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    return len([n for n in names if n not in ("self", "cls")])


@pytest.mark.parametrize("path", sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")))
def test_wide_functions_take_a_config_object(path):
    """Outside the CLI (whose commands and their helpers turn flags into config objects) and kernels,
    more than MAX_PARAMETERS parameters of any kind means the settings belong in one config object (as
    build_draft_bundle's DraftBundleConfig)."""
    if path.startswith("cli/"):
        return
    tree = ast.parse((PACKAGE / path).read_text())
    wide = {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
        and not _is_command(n)
        and not _is_kernel(n)
        and _parameters(n) > MAX_PARAMETERS
    }
    debt = WIDE_DEBT.get(path, set())
    assert wide - debt == set(), f"{path}: more than {MAX_PARAMETERS} parameters (take a config object)"
    assert debt - wide == set(), f"{path}: {sorted(debt - wide)} no longer wide: drop them from WIDE_DEBT"


# A repository path named in prose: a top-level folder, then path characters. A name followed by a
# placeholder (`results/gpu-<date>.json`, `*`) is a pattern, not a path.
NAMED_PATH = re.compile(r"(?<![\w./-])((?:fp8ptq|tests|benchmarks|recipes|docs|\.ci)/[\w.+/-]*)([<*{$]?)")
# Named on purpose though absent from a clone: made by a setup command, or a user's own file in an example.
MADE_OR_EXAMPLE = {
    "benchmarks/.venv-llmc",  # bash benchmarks/setup_llmc_venv.sh
    "benchmarks/.venv-llmc/bin/python",
    "benchmarks/.venv-autoround/bin/python",  # bash benchmarks/setup_autoround_venv.sh
    "recipes/my-model-fp8.yaml",  # docs/ci.md: the user's recipe
    "fp8ptq/compressed-tensors",  # prose: "an fp8ptq/compressed-tensors checkpoint"
    "fp8ptq/ops/planted",  # the planted module of test_a_planted_upward_import_is_caught
}


def _in_venv(path: Path, root: Path) -> bool:
    """Inside a virtual environment (benchmarks/.venv-llmc from setup_llmc_venv.sh): not the project's."""
    return any(part.startswith(".venv") for part in path.relative_to(root).parts)


def named_paths(root: Path) -> dict[str, list[str]]:
    """{path: [file:line, ...]} for every repository path the docs, BENCHMARKS.md and the sources' comments
    and docstrings name that does not exist. docs/notebook/ is history: it names what existed then."""
    texts = [root / "README.md", root / "BENCHMARKS.md", root / "CONTRIBUTING.md", *(root / "docs").glob("*.md")]
    texts += [p for d in ("fp8ptq", "tests", "benchmarks") for p in (root / d).rglob("*.py") if not _in_venv(p, root)]
    texts += [p for p in (root / "benchmarks").rglob("*.sh") if not _in_venv(p, root)] + [root / "Makefile"]
    missing: dict[str, list[str]] = {}
    for f in sorted(t for t in texts if t.exists() and t.name != "test_house.py"):  # this file plants paths
        for i, line in enumerate(f.read_text().splitlines(), 1):
            for m in NAMED_PATH.finditer(line):
                path = m.group(1).rstrip(".,:;-/")
                if m.group(2) or path in MADE_OR_EXAMPLE:
                    continue
                if path not in MADE_OR_EXAMPLE and not (root / path).exists():
                    missing.setdefault(path, []).append(f"{f.relative_to(root)}:{i}")
    return missing


def test_every_named_path_exists():
    assert named_paths(PACKAGE.parent) == {}


def test_a_moved_path_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("")
    (tmp_path / "docs" / "x.md").write_text("see tests/test_a.py and tests/test_b.py, or tests/gpu-<date>.json\n")
    assert named_paths(tmp_path) == {"tests/test_b.py": ["docs/x.md:1"]}


def private_imports(root: Path) -> list[str]:
    """`from fp8ptq.x import _name` anywhere under root (a copy of the fp8ptq package)."""
    bad = []
    for f in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fp8ptq":
                names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                bad += [f"{f.relative_to(root.parent)}:{node.lineno} imports {node.module}.{n}" for n in names]
    return bad


def test_no_private_imports_across_modules(tmp_path):
    assert private_imports(PACKAGE) == []
    (tmp_path / "fp8ptq").mkdir()
    (tmp_path / "fp8ptq" / "m.py").write_text("def f():\n    from fp8ptq.ops.gptq import _solve\n")
    assert private_imports(tmp_path / "fp8ptq") == ["fp8ptq/m.py:2 imports fp8ptq.ops.gptq._solve"]


def format_literals(root: Path) -> list[str]:
    """String constants naming a compressed-tensors format (`CompressionFormat`) in modules outside ops/
    and quantization/schemes/ under root (a copy of the fp8ptq package): what a format means is its handler's
    to say (`format`, `stored_tensors`, `vllm_cpu_refusal`, ...), so a new format touches no other file."""
    from compressed_tensors.config import CompressionFormat

    names = {f.value for f in CompressionFormat}
    bad = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if rel.startswith(("ops/", "quantization/schemes/")):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                bad.append(f"{root.name}/{rel}:{node.lineno} '{node.value}'")
    return bad


def test_no_format_names_outside_the_scheme_handlers(tmp_path):
    assert format_literals(PACKAGE) == []
    (tmp_path / "fp8ptq" / "ops").mkdir(parents=True)
    (tmp_path / "fp8ptq" / "ops" / "ok.py").write_text("F = 'nvfp4-pack-quantized'\n")
    (tmp_path / "fp8ptq" / "m.py").write_text("def f(fmt):\n    return fmt == 'pack-quantized'\n")
    assert format_literals(tmp_path / "fp8ptq") == ["fp8ptq/m.py:2 'pack-quantized'"]


def verification_sites(root: Path) -> list[str]:
    """Calls of `verify_drafts` (speculative verification) under root (a copy of the fp8ptq package)."""
    return [
        f"{f.relative_to(root.parent)}:{node.lineno}"
        for f in sorted(root.rglob("*.py"))
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "verify_drafts"
    ]


def test_one_speculative_loop():
    """One generation loop verifies drafts (spec/measure.py), whatever the proposer (spec/proposers.py):
    a second loop for a new proposer is refused here."""
    sites = verification_sites(PACKAGE)
    assert len(sites) == 1 and sites[0].startswith("fp8ptq/spec/measure.py:"), sites


def options_written_twice(root: Path) -> list[str]:
    """Commands under root/cli that list an option as a parameter and again to build their config: a call
    `SomethingConfig(name=name, ...)` whose `name` is a parameter of the enclosing function. A command
    takes its options from the config's fields instead (cli/fielded.py)."""
    bad = []
    for f in sorted((root / "cli").glob("*.py")):
        for fn in ast.parse(
            f.read_text()
        ).body:  # commands and their helpers (a closure's own arguments are not options)
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
            for call in ast.walk(fn):
                if not isinstance(call, ast.Call):
                    continue
                name = getattr(call.func, "id", None) or getattr(call.func, "attr", "")
                if not name.endswith("Config"):
                    continue
                again = [k.arg for k in call.keywords if isinstance(k.value, ast.Name) and k.value.id == k.arg]
                again = [k for k in again if k in params]
                if again:
                    where = f"{f.relative_to(root.parent)}:{call.lineno}"
                    bad.append(f"{where} {fn.name} lists {', '.join(again)} again for {name}")
    return bad


def test_no_command_lists_its_options_twice(tmp_path):
    assert options_written_twice(PACKAGE) == []
    (tmp_path / "fp8ptq" / "cli").mkdir(parents=True)
    planted = "def cmd(model, output, json_out):\n    run(XConfig(model=model, output=output, dry=False))\n"
    (tmp_path / "fp8ptq" / "cli" / "c.py").write_text(planted)
    assert options_written_twice(tmp_path / "fp8ptq") == ["fp8ptq/cli/c.py:2 cmd lists model, output again for XConfig"]


def test_every_option_comes_from_one_field_or_belongs_to_its_command():
    """A generated command's options are its config's documented fields plus its own flags; an own flag
    that fills a field of another config names it (fielded.field_option)."""
    import typer.main

    from fp8ptq.cli import app
    from fp8ptq.cli.fielded import fields_of

    generated = 0
    for name, cmd in typer.main.get_command(app).commands.items():
        for sub in getattr(cmd, "commands", {name: cmd}).values():
            mapping = fields_of(sub.callback)
            if not mapping:
                continue
            generated += 1
            for cls, field in mapping.values():
                assert field in cls.__dataclass_fields__, (name, field)
    assert generated >= 14  # quantize, model-free, convert, inspect, analyze, verify, draft-*, eval x3, spec x3


NOTEBOOK_IDS = re.compile(r"\b(issues?|stops?) #?\d+|\bseed article", re.IGNORECASE)


def notebook_identifiers(root: Path) -> list[str]:
    """Issue and stop numbers in the sources and recipes under root (a copy of the fp8ptq package): code
    states its constraint and reason; where a number came from belongs in BENCHMARKS.md or the notebook."""
    bad = []
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.yaml")]):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if NOTEBOOK_IDS.search(line):
                bad.append(f"{f.relative_to(root.parent)}:{i}")
    return bad


def test_no_issue_or_stop_numbers_in_the_code(tmp_path):
    assert notebook_identifiers(PACKAGE) == []
    (tmp_path / "fp8ptq").mkdir()
    (tmp_path / "fp8ptq" / "m.py").write_text('"""Faster GEMMs (issue 35)."""\n# fine: vLLM #40177\n')
    (tmp_path / "fp8ptq" / "r.yaml").write_text("# since stop 56\nname: r\n")
    assert notebook_identifiers(tmp_path / "fp8ptq") == ["fp8ptq/m.py:1", "fp8ptq/r.yaml:1"]


MAX_FUNCTION_LINES = 80


def long_functions(root: Path) -> list[str]:
    """Functions longer than MAX_FUNCTION_LINES outside root/cli (a copy of the fp8ptq package): a reader
    holds one screen; the typer commands, which mostly print tables, are exempt."""
    bad = []
    for f in sorted(root.rglob("*.py")):
        if f.relative_to(root).parts[0] == "cli":
            continue
        for fn in ast.walk(ast.parse(f.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = fn.end_lineno - fn.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    bad.append(f"{f.relative_to(root.parent)}:{fn.lineno} {fn.name} ({n} lines)")
    return bad


def test_functions_fit_on_a_screen(tmp_path):
    assert long_functions(PACKAGE) == []
    (tmp_path / "fp8ptq" / "cli").mkdir(parents=True)
    body = "def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    (tmp_path / "fp8ptq" / "m.py").write_text(body)
    (tmp_path / "fp8ptq" / "cli" / "c.py").write_text(body)  # a command may print a long table
    assert long_functions(tmp_path / "fp8ptq") == [f"fp8ptq/m.py:1 f ({MAX_FUNCTION_LINES + 1} lines)"]
