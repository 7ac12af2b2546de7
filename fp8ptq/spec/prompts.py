"""Prompts for generating training data (draft-train) and for measuring acceptance (spec measure).

The built-in set is instruction prompts over CPython's help topics (`fp8ptq.data.builtin_texts`): the
calibration split for training, the evaluation split for measurement, so measurement prompts are held
out from what the draft was trained on. A user file (--prompts) is any source `fp8ptq.data.load_texts`
reads (.txt: one prompt per blank-line-separated block; .jsonl/.parquet: --text-field).
"""

from __future__ import annotations

import random

from fp8ptq.data import BUILTIN, load_texts, render_chat
from fp8ptq.spec import SpecError

_TEMPLATES = (
    "Explain the following Python documentation in simple terms:\n\n{}",
    "Summarize this passage in a few sentences:\n\n{}",
    "Write a short Python example that illustrates this:\n\n{}",
    "What are the key points of the following text?\n\n{}",
    "Rewrite this for a beginner:\n\n{}",
)


def _snippet(text: str, chars: int) -> str:
    text = " ".join(text.split())
    if len(text) <= chars:
        return text
    cut = text[:chars]
    end = cut.rfind(". ")
    return cut[: end + 1] if end > chars // 3 else cut


def builtin_prompts(split: str, n: int, seed: int = 0, snippet_chars: int = 400) -> list[str]:
    """n instruction prompts from the built-in text (split: 'calibration' for training, 'evaluation' held out)."""
    texts = [t for t in load_texts(BUILTIN, split) if len(t.strip()) > 80]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        order = list(range(len(texts)))
        rng.shuffle(order)
        for i in order[: n - len(out)]:
            offset = rng.randrange(0, max(1, len(texts[i]) - snippet_chars)) if len(out) >= len(texts) else 0
            out.append(rng.choice(_TEMPLATES).format(_snippet(texts[i][offset:], snippet_chars)))
    return out


def load_prompts(source: str | None, split: str, n: int, seed: int = 0, text_field: str = "text") -> list[str]:
    """Built-in prompts (source None or 'builtin') or the first n prompts of a user file."""
    if source in (None, BUILTIN):
        return builtin_prompts(split, n, seed)
    texts = [t.strip() for t in load_texts(source, split, text_field) if t.strip()]
    if not texts:
        raise SpecError(
            f"prompt file '{source}' has no prompts",
            fix="one prompt per blank-line-separated block (.txt) or per line (.jsonl)",
        )
    return texts[:n]


def encode_prompts(tokenizer, prompts: list[str], chat_template: bool = True, max_tokens: int = 256) -> list[list[int]]:
    """Token ids per prompt: the tokenizer's chat template (user turn + generation prompt) when it has one,
    left-truncated to max_tokens so the end of the template (the assistant turn) is kept."""
    out = []
    use_chat = chat_template and getattr(tokenizer, "chat_template", None)
    for p in prompts:
        if use_chat:
            ids = render_chat(tokenizer, [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(p, add_special_tokens=True)["input_ids"]
        out.append(list(ids)[-max_tokens:])
    return out
