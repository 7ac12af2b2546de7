"""README's `fp8ptq quantize` option table, rendered from the command: each row's option names and
default come from the typer command, its meaning from the option's help — which the command takes from
the config field's documentation (fp8ptq.fields, cli/fielded.py) — plus the field's `more`. So the
table, `--help` and the defaults the run uses cannot disagree; tests/cli/test_defaults.py holds README
to what this prints.

    python -m fp8ptq.cli.options             # print the table
    python -m fp8ptq.cli.options --write     # refresh it in README.md
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import typer.main

from fp8ptq.cli import app
from fp8ptq.cli.fielded import fields_of
from fp8ptq.fields import doc_of

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN = "<!-- quantize options: rendered by `python -m fp8ptq.cli.options --write` -->\n"
END = "<!-- end quantize options -->"


def _default_cell(p, shown: str | None) -> str:
    if shown is not None:
        return shown
    v = p.default
    if p.required:
        return "— (required)"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, (list, tuple)):
        return f"`{v[0]}`" if len(v) == 1 else "—"
    if v is None:
        return "—"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v) if isinstance(v, (int, float)) else f"`{v}`"


def _names(p) -> str:
    long = [o for o in p.opts if o.startswith("--")]
    short = [o for o in p.opts if not o.startswith("--")]
    name = "/".join(long[:1] + short)
    return f"{name} {p.metavar}" if p.metavar else name


def quantize_table() -> str:
    """The table, header and one row per option, in the command's order."""
    cmd = typer.main.get_command(app).commands["quantize"]
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for p in cmd.params:
        if p.param_type_name != "option" or p.name == "help":
            continue
        where = fields_of(cmd.callback).get(p.name)
        doc = doc_of(*where) if where else {}
        meaning = ((p.help or "") + doc.get("more", "")).replace("|", r"\|")
        rows.append(f"| `{_names(p)}` | {_default_cell(p, doc.get('shown'))} | {meaning} |")
    return "\n".join(rows) + "\n"


def rendered(text: str) -> str:
    """README's text with the table between the markers replaced by quantize_table()."""
    block = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
    if not block.search(text):
        raise ValueError(f"README has no '{BEGIN.strip()}' ... '{END}' block")
    return block.sub(lambda _m: BEGIN + quantize_table() + END, text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="refresh the table in README.md")
    args = ap.parse_args(argv)
    if args.write:
        README.write_text(rendered(README.read_text()))
    else:
        print(quantize_table(), end="")


if __name__ == "__main__":
    main()
