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
    """Tokenize, concatenate (EOS between documents), cut into seq_len chunks, pick num_samples of them.

    Returns input ids [num_samples, seq_len] (int64). Chunks are chosen by a seeded permutation, so the
    same data and seed always give the same samples.
    """
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise DataError(f"{source} is empty", fix="pass a file with text in it")
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("--chat-template was asked for but the tokenizer has no chat template")
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False) for t in texts]
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids + sep)
    n_chunks = len(stream) // seq_len
    if n_chunks < num_samples:
        raise DataError(
            f"{source} has {len(stream)} tokens: {n_chunks} samples of {seq_len}, {num_samples} requested",
            fix="provide more text, or lower --num-samples / --seq-len",
        )
    import torch  # here, not at import: `fp8ptq.api` and the CLI's help import this module without torch

    chunks = torch.tensor(stream[: n_chunks * seq_len], dtype=torch.long).view(n_chunks, seq_len)
    pick = torch.randperm(n_chunks, generator=torch.Generator().manual_seed(seed))[:num_samples]
    return chunks[pick.sort().values]


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
