import json

import pytest
import torch

from fp8ptq.data import builtin_texts, load_samples, load_texts, pack_tokens
from fp8ptq.errors import DataError

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_builtin_split_is_disjoint_and_stable():
    cal, ev = builtin_texts("calibration"), builtin_texts("evaluation")
    assert cal and ev and not set(cal) & set(ev)
    assert 0.1 < len(ev) / (len(cal) + len(ev)) < 0.3
    assert builtin_texts("evaluation") == ev


def test_samples_are_deterministic_and_shaped(tok):
    a = load_samples("builtin", tok, 4, 64, seed=3)
    b = load_samples("builtin", tok, 4, 64, seed=3)
    c = load_samples("builtin", tok, 4, 64, seed=4)
    assert a.shape == (4, 64) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_file_formats(tmp_path, tok):
    import datasets

    texts = [f"document number {i} says something about quantization. " * 20 for i in range(20)]
    (tmp_path / "a.txt").write_text("\n\n".join(texts))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts))
    datasets.Dataset.from_dict({"text": texts}).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "ds"))
    assert load_texts(str(tmp_path / "a.txt")) == texts
    assert load_texts(str(tmp_path / "a.jsonl"), text_field="body") == texts
    assert load_texts(str(tmp_path / "a.parquet")) == texts
    assert load_texts(str(tmp_path / "ds")) == texts
    ids = load_samples(str(tmp_path / "a.jsonl"), tok, 2, 32, text_field="body")
    assert ids.shape == (2, 32)


def test_chat_template_wrapping(tok):
    start = tok.convert_tokens_to_ids("<|im_start|>")
    plain = pack_tokens(["hello world"] * 40, tok, 4, 16)
    chat = pack_tokens(["hello world"] * 40, tok, 4, 16, chat_template=True)
    assert (chat == start).any() and not (plain == start).any()


def test_empty_and_short_data_are_clear_errors(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(DataError, match="empty"):
        load_samples(str(tmp_path / "empty.txt"), tok, 1, 16)
    (tmp_path / "short.txt").write_text("just a few words")
    with pytest.raises(DataError, match="requested"):
        load_samples(str(tmp_path / "short.txt"), tok, 4, 512)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"other": 1}\n')
    with pytest.raises(DataError, match="line 2"):
        load_texts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(DataError, match="not found"):
        load_texts(str(tmp_path / "nope.txt"))


def test_weighted_mix_of_sources(tmp_path, tok):
    from fp8ptq.data import mix_counts, parse_mix

    assert parse_mix("builtin") == [("builtin", 1.0)]
    assert parse_mix("a.txt:0.25,b.jsonl:0.75") == [("a.txt", 0.25), ("b.jsonl", 0.75)]
    assert parse_mix("dir/x:y.txt") == [("dir/x:y.txt", 1.0)]  # not a number: part of the path
    assert mix_counts([0.5, 0.5], 7) in ([4, 3], [3, 4]) and mix_counts([1, 3], 8) == [2, 6]
    assert sum(mix_counts([0.2, 0.3, 0.5], 64)) == 64
    prose = tmp_path / "p.txt"
    prose.write_text("\n\n".join(" ".join(reversed(t.split())) for t in builtin_texts("evaluation")))
    mixed = load_samples(f"builtin:1,{prose}:3", tok, 8, 64, seed=2)
    assert mixed.shape == (8, 64)
    # each source's share is what it alone gives for that many samples, in the order given
    assert torch.equal(mixed[:2], load_samples("builtin", tok, 2, 64, seed=2))
    assert torch.equal(mixed[2:], load_samples(str(prose), tok, 6, 64, seed=2))
    for bad in ("builtin:0", "builtin:-1", ":0.5"):
        with pytest.raises(DataError, match="PATH:WEIGHT"):
            load_samples(bad, tok, 2, 64)


def _bos_tokenizer(tokenizer_dir):
    """The test tokenizer made to open every text with a BOS, as Gemma's and Llama's tokenizers do."""
    from tokenizers import Tokenizer, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    base = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    inner = Tokenizer.from_str(base.backend_tokenizer.to_str())
    bos = base.convert_tokens_to_ids("<|im_start|>")
    inner.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B", special_tokens=[("<|im_start|>", bos)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<|im_start|>", eos_token="<|endoftext|>")
    return tok, bos


def test_windows_open_with_the_bos_the_tokenizer_adds(tok, tokenizer_dir):
    from fp8ptq.data import text_prefix

    bos_tok, bos = _bos_tokenizer(tokenizer_dir)
    assert text_prefix(tok) == [] and text_prefix(bos_tok) == [bos]
    plain, opened = load_samples("builtin", tok, 4, 64), load_samples("builtin", bos_tok, 4, 64)
    assert opened.shape == plain.shape == (4, 64)
    assert (opened[:, 0] == bos).all() and not (plain[:, 0] == bos).all()
    assert (opened[:, 1:] != bos).all()  # then running text (the test text holds no BOS)
    with pytest.raises(DataError, match="leaves no room"):
        load_samples("builtin", bos_tok, 1, 1)
