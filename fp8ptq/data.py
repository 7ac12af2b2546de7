"""Calibration and evaluation text: sources, tokenization, packing into fixed-length samples.

Built-in source: `pydoc_data.topics.topics` (CPython's help topics, ~0.8 MB of technical English, no
network). Fixed split: a topic belongs to the evaluation split iff crc32(topic name) % 5 == 0 (about
20%), to the calibration split otherwise, so evaluation text never overlaps calibration text.
User sources: .txt (one document per blank-line-separated paragraph block), .jsonl (one document per
line, field --text-field), .parquet, or a `datasets.save_to_disk` folder. Several sources mix by weight:
'builtin:0.5,prose.txt:0.5' (`quantize --data builtin:0.5 --data prose.txt:0.5`).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from fp8ptq.errors import DataError

if TYPE_CHECKING:
    import torch

Split = Literal["calibration", "evaluation"]
BUILTIN = "builtin"


def builtin_texts(split: Split) -> list[str]:
    from pydoc_data.topics import topics

    want_eval = split == "evaluation"
    return [topics[k] for k in sorted(topics) if (zlib.crc32(k.encode()) % 5 == 0) == want_eval]


def _column(rows, field: str, source: str) -> list[str]:
    if field not in rows.column_names:
        raise DataError(
            f"'{source}' has no field '{field}' (fields: {', '.join(rows.column_names)})", fix="pass --text-field NAME"
        )
    return [t for t in rows[field] if isinstance(t, str)]


def load_texts(source: str, split: Split = "calibration", text_field: str = "text") -> list[str]:
    """Documents from a source. For user files the split is ignored: the user chose the file."""
    if source == BUILTIN:
        return builtin_texts(split)
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(
            f"data source '{source}' not found",
            fix="pass 'builtin' or an existing .txt/.jsonl/.parquet file or dataset folder",
        )
    if not path.is_dir():
        _check_data_file(path, source)
    if path.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as err:
            raise DataError(f"'{path}' is not a datasets.save_to_disk folder ({err})") from None
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return _column(ds, text_field, source)
    suffix = path.suffix.lower()
    if suffix == ".txt":
        text = path.read_text(encoding="utf-8", errors="replace")
        bad = text.count("\ufffd") + text.count("\x00")
        if bad > max(16, len(text) // 100):  # a stray byte is tolerated; a binary file is not text
            raise DataError(
                f"'{path}' is not UTF-8 text ({bad} of {len(text)} characters undecodable)",
                fix="pass a UTF-8 .txt file (documents separated by blank lines), .jsonl or .parquet",
            )
        return [b for b in text.split("\n\n") if b.strip()]
    if suffix == ".jsonl":
        texts = []
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as err:
            raise DataError(f"'{path}' is not UTF-8 JSON lines ({err})", fix="write it as UTF-8") from None
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"'{path}' line {i} is not JSON ({err})") from None
            if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
                raise DataError(f"'{path}' line {i} has no string field '{text_field}'", fix="pass --text-field NAME")
            texts.append(row[text_field])
        return texts
    if suffix == ".parquet":
        import datasets

        try:
            ds = datasets.Dataset.from_parquet(str(path))
        except Exception as err:  # noqa: BLE001 - pyarrow and datasets raise assorted types on a bad file
            raise DataError(f"'{path}' is not a readable parquet file ({type(err).__name__}: {err})") from None
        return _column(ds, text_field, source)
    raise DataError(f"unsupported data file '{path}'", fix="use .txt, .jsonl, .parquet or a datasets folder")


def data_limit() -> int:
    """The largest data file read, bytes: FP8PTQ_MAX_DATA_BYTES, default 2 GiB (calibration takes a few MB)."""
    import os

    raw = os.environ.get("FP8PTQ_MAX_DATA_BYTES", "")
    return int(raw) if raw.isdigit() else 2 << 30


def _check_data_file(path: Path, source: str) -> None:
    """A data source is a regular file of bounded size: a FIFO blocks its read for ever, /dev/zero never
    ends, and a file larger than any calibration needs would be read whole into memory."""
    if not path.is_file():
        raise DataError(f"data source '{source}' is not a regular file (a FIFO or device?)", fix="pass a text file")
    size, limit = path.stat().st_size, data_limit()
    if size > limit:
        raise DataError(
            f"data source '{source}' is {size:,} bytes, above the {limit:,}-byte limit",
            fix="pass a smaller sample of it, or raise the limit with FP8PTQ_MAX_DATA_BYTES=BYTES",
        )


def pack_tokens(
    texts: list[str],
    tokenizer,
    num_samples: int,
    seq_len: int,
    seed: int = 0,
    *,
    chat_template: bool = False,
    source: str = "data",
) -> torch.Tensor:
    """Tokenize, concatenate (EOS between documents), cut into seq_len windows, pick num_samples of them.

    Every window opens with the tokens the tokenizer puts before any text (`text_prefix`: Gemma's and
    Llama's BOS, nothing for GPT-2-style tokenizers such as SmolLM2's), as every prompt the engine serves
    does: a model's first position (an attention sink) is unlike the others, and calibration and the
    quality numbers must see it as served. Returns input ids [num_samples, seq_len] (int64). Windows are
    chosen by a seeded permutation, so the same data and seed always give the same samples.
    """
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(f"{source} is empty", fix="pass a file with text in it")
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("--chat-template was asked for but the tokenizer has no chat template")
        texts = [render_chat(tokenizer, [{"role": "user", "content": t}], tokenize=False) for t in texts]
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids + sep)
    prefix = text_prefix(tokenizer)
    body = seq_len - len(prefix)
    if body < 1:
        raise DataError(f"--seq-len {seq_len} leaves no room after the tokenizer's {prefix} prefix", fix="raise it")
    n_chunks = len(stream) // body
    if n_chunks < num_samples:
        raise DataError(
            f"{source} has {len(stream)} tokens: {n_chunks} samples of {seq_len}, {num_samples} requested",
            fix="provide more text, or lower --num-samples / --seq-len",
        )
    import torch  # here, not at import: `fp8ptq.api` and the CLI's help import this module without torch

    chunks = torch.tensor(stream[: n_chunks * body], dtype=torch.long).view(n_chunks, body)
    if prefix:
        chunks = torch.cat([torch.tensor(prefix, dtype=torch.long).expand(n_chunks, -1), chunks], dim=1)
    pick = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(seed))[:num_samples]
    return chunks[pick.sort().values]


def text_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer places before any text when it adds its special tokens (what a served prompt
    opens with): [bos] for Gemma and Llama tokenizers, [] for SmolLM2's and GPT-2's. Read off the
    tokenizer itself, by encoding one text with and without its special tokens."""
    probe = "The"
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    bare = tokenizer(probe, add_special_tokens=False)["input_ids"]
    for k in range(len(full) - len(bare) + 1):
        if full[k : k + len(bare)] == bare:
            return list(full[:k])
    return []


def parse_mix(source: str) -> list[tuple[str, float]]:
    """'a.txt:0.5,b.jsonl:0.5' -> [(a.txt, 0.5), (b.jsonl, 0.5)]: several sources joined by commas (the
    CLI joins repeated --data options), each with an optional ':WEIGHT' (default 1). One source without a
    weight is the plain case."""
    out = []
    for part in source.split(","):
        path, sep, weight = part.rpartition(":")
        try:
            w = float(weight) if sep else None
        except ValueError:
            w = None
        if w is None:
            path, w = part, 1.0
        if not path or not w > 0 or w == float("inf"):
            raise DataError(f"data source '{part}' in '{source}': expected PATH or PATH:WEIGHT with a weight > 0")
        out.append((path, w))
    return out


def mix_counts(weights: list[float], num_samples: int) -> list[int]:
    """Samples per source in proportion to the weights (largest remainders; every source at least one
    sample when num_samples allows)."""
    total = sum(weights)
    exact = [num_samples * w / total for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: counts[i] - exact[i])[: num_samples - sum(counts)]:
        counts[i] += 1
    return counts


def load_samples(
    source: str,
    tokenizer,
    num_samples: int,
    seq_len: int,
    split: Split = "calibration",
    seed: int = 0,
    *,
    text_field: str = "text",
    chat_template: bool = False,
) -> torch.Tensor:
    """[num_samples, seq_len] token ids from one source, or from a weighted mix (`parse_mix`): each source
    packed on its own, its share of the samples picked by the same seeded rule, concatenated in order."""
    mix = parse_mix(source)
    counts = mix_counts([w for _, w in mix], num_samples) if len(mix) > 1 else [num_samples]
    parts = []
    for (path, _), n in zip(mix, counts):
        if n == 0:
            continue
        texts = load_texts(path, split, text_field)
        label = f"built-in {split} text" if path == BUILTIN else f"'{path}'"
        parts.append(pack_tokens(texts, tokenizer, n, seq_len, seed, chat_template=chat_template, source=label))
    if len(parts) == 1:
        return parts[0]
    import torch

    return torch.cat(parts)


TEMPLATE_SECONDS = 10.0  # one render of a checkpoint's chat template
TEMPLATE_CHARS = 1 << 22  # the longest string a template may build (a rendered prompt is a few KB)


def check_chat_template(template: str) -> None:
    """DataError unless a checkpoint's chat template renders a probe conversation within TEMPLATE_SECONDS
    and builds no string or list longer than TEMPLATE_CHARS: it is the model author's code, run by
    transformers in Jinja's sandbox, which bounds `range` but not `'A' * 5000000000` (5 GB) nor two
    nested range(100000) loops (never ending). Rendered here in a sandbox that also bounds `*`, `**` and
    `+`, with the names transformers gives templates."""
    import json

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    from fp8ptq.io import time_limit  # here: fp8ptq.io imports torch, which `fp8ptq --help` must not

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context, operator, left, right):
            sized = [len(v) for v in (left, right) if isinstance(v, (str, list, tuple))]
            count = [v for v in (left, right) if isinstance(v, int) and not isinstance(v, bool)]
            if operator == "*" and sized and count and sized[0] * max(count[0], 0) > TEMPLATE_CHARS:
                raise SecurityError(f"a string or list repeated {count[0]:,} times")
            if operator == "+" and len(sized) == 2 and sum(sized) > TEMPLATE_CHARS:
                raise SecurityError("a string or list longer than the limit")
            if operator == "**" and len(count) == 2 and abs(count[1]) > 1024:
                raise SecurityError(f"a power of {count[1]:,}")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: "2026-01-01")
    probe = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."}]
    probe.append({"role": "user", "content": "How are you?"})
    try:
        compiled = env.from_string(template)
        with time_limit(TEMPLATE_SECONDS):
            out = compiled.render(messages=probe, add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    except TimeoutError:
        raise DataError(
            f"the tokenizer's chat template did not render a 3-turn conversation in {TEMPLATE_SECONDS:g} s",
            fix="fix or replace the model's chat template (chat_template.jinja / tokenizer_config.json)",
        ) from None
    except (jinja2.TemplateError, SecurityError, RecursionError, MemoryError) as err:
        raise DataError(
            f"the tokenizer's chat template cannot be rendered ({type(err).__name__}: {str(err)[:200]})",
            fix="fix or replace the model's chat template (chat_template.jinja / tokenizer_config.json)",
        ) from None
    if len(out) > TEMPLATE_CHARS:
        raise DataError(f"the tokenizer's chat template renders {len(out):,} characters for 3 short turns")


_CHECKED: set[str] = set()


def render_chat(tokenizer, messages: list[dict], **kw):
    """tokenizer.apply_chat_template(messages, **kw) (a tokenizer or a processor), its template checked
    first (check_chat_template, once per template) and the render itself bounded in time; a template that
    raises is one DataError."""
    import jinja2

    from fp8ptq.io import time_limit

    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template not in _CHECKED:
        check_chat_template(template)
        _CHECKED.add(template)
    try:
        with time_limit(TEMPLATE_SECONDS):
            return tokenizer.apply_chat_template(messages, **kw)
    except TimeoutError:
        raise DataError(f"the tokenizer's chat template took over {TEMPLATE_SECONDS:g} s on one prompt") from None
    except jinja2.TemplateError as err:
        raise DataError(
            f"the tokenizer's chat template raised on a prompt ({type(err).__name__}: {str(err)[:200]})",
            fix="fix or replace the model's chat template, or leave the chat template out (--no-chat-template)",
        ) from None
