"""Speculative-decoding pipelines on tiny random Llamas (real tokenizer): draft-train, resume, draft-trim,
measure, recommend, the bundle, and the CLI's errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from fp8ptq.draft.train import DATA_FILE, DraftSummary, DraftTrainConfig, batch_indices, draft_train, work_dir
from fp8ptq.draft.trim import TOKEN_MAP, DraftTrimConfig, choose_kept, d2t_offsets, draft_trim
from fp8ptq.results import read_json, to_json
from fp8ptq.spec import SpecError
from fp8ptq.spec.acceptance import read_measurement
from fp8ptq.spec.measure import (
    AcceptancePlan,
    Decoding,
    SpecStats,
    measure_acceptance,
    replay_greedy,
    speculative_generate,
)
from fp8ptq.spec.models import DRAFT_META, TRIM_META, NgramDraft, TrimSummary, load_draft, load_target, parse_ngram
from fp8ptq.spec.run import MeasureConfig, RecommendConfig, load_any_draft, measure, recommend

pytestmark = pytest.mark.tiny

SMALL = dict(num_prompts=6, gen_tokens=12, gen_batch_size=3, batch_size=3, checkpoint_every=2)


def _train(target, out, **kw):
    return draft_train(DraftTrainConfig(target=str(target), output=out, layers=1, **{**SMALL, **kw}))


@pytest.fixture(scope="module")
def drafted(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("spec") / "draft"
    meta = _train(tiny_dir, out, max_steps=4, time_budget_s=None)
    return out, meta


def test_draft_train_artefacts(drafted, tiny_dir):
    out, meta = drafted
    cfg, tcfg = json.loads((out / "config.json").read_text()), json.loads((tiny_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == tcfg["vocab_size"]
    assert "quantization_config" not in cfg and cfg["tie_word_embeddings"]
    assert (out / "tokenizer.json").is_file() and (out / DATA_FILE).is_file()
    # engines load every *.safetensors file in a model dir as weights: only the model may be one
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert meta.steps == 4 and meta.stopped_by == "max_steps" and meta.loss_last < meta.loss_first + 1.0
    assert not work_dir(out).exists()  # removed after success
    assert read_json(out / DRAFT_META, DraftSummary) == replace(meta, losses=())  # the file, validated
    assert len(meta.losses) == 4 and "losses" not in json.loads((out / DRAFT_META).read_text())
    # the draft's layer 0 started as the target's layer 0; the embedding (tied LM head) is the target's
    d, t = load_file(str(out / "model.safetensors")), load_file(str(tiny_dir / "model.safetensors"))
    assert torch.equal(d["model.embed_tokens.weight"], t["model.embed_tokens.weight"])
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(out))  # plain HF load works
    assert m.config.vocab_size == tcfg["vocab_size"]


def test_resume_equals_uninterrupted(tmp_path, tiny_dir, drafted):
    """Stop after 1 step (time budget 0), resume to 4: same weights as the 4-step run."""
    out = tmp_path / "resumed"
    first = _train(tiny_dir, out, max_steps=4, time_budget_s=0.0, keep_work=True)
    assert first.steps == 1 and first.stopped_by == "time_budget"
    assert (work_dir(out) / "checkpoint.safetensors").is_file()
    second = _train(tiny_dir, out, max_steps=4, time_budget_s=None, resume=True, overwrite=True)
    assert second.resumed_from == 1 and second.steps == 4
    a = load_file(str(drafted[0] / "model.safetensors"))
    b = load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.losses == drafted[1].losses


def test_a_second_training_run_for_the_same_output_is_refused_at_once(tmp_path, tiny_dir):
    """Both trainers keep a work directory beside the output: a run holding its lock (here the test, as
    another process would) makes the second fail before it loads anything, and nothing is written."""
    from fp8ptq.draft.eagle3_train import Eagle3TrainConfig, eagle3_train
    from fp8ptq.errors import OutputError
    from fp8ptq.export.rundir import output_lock

    out = tmp_path / "d"
    with output_lock(out):
        with pytest.raises(OutputError, match="another fp8ptq run is writing"):
            _train(tiny_dir, out, max_steps=1)
        with pytest.raises(OutputError, match="another fp8ptq run is writing"):
            eagle3_train(Eagle3TrainConfig(target=str(tiny_dir), output=out, max_steps=1))
    assert list(tmp_path.iterdir()) == []  # the lock file went with the lock; no work directory


def test_batch_order_is_a_function_of_step():
    seen = [i for s in range(4) for i in batch_indices(s, 3, 6, seed=1)]
    assert sorted(seen[:6]) == list(range(6)) and sorted(seen[6:]) == list(range(6))
    assert batch_indices(3, 3, 6, 1) == batch_indices(3, 3, 6, 1)


def test_trim_choice_and_d2t():
    counts = torch.tensor([0, 5, 9, 9, 1, 0, 7, 2])
    kept = choose_kept(counts, 4, special_ids=[0])
    assert kept.tolist() == [0, 2, 3, 6]  # 0 forced in (special), then 9, 9, 7
    assert (d2t_offsets(kept) + torch.arange(4)).tolist() == kept.tolist()
    with pytest.raises(SpecError, match="--keep"):
        choose_kept(counts, 0, special_ids=[0])


def test_draft_trim_outputs(tmp_path, drafted, tiny_dir):
    out = tmp_path / "trimmed"
    s = draft_trim(DraftTrimConfig(draft=drafted[0], target=str(tiny_dir), keep=300, output=out))
    st = load_file(str(out / "model.safetensors"))
    kept = torch.tensor(json.loads((out / "kept_token_ids.json").read_text()))
    assert st["lm_head.weight"].shape[0] == 300 and st["model.embed_tokens.weight"].shape[0] == s.vocab
    assert torch.equal(st["d2t"] + torch.arange(300), kept) and int(st["t2d"].sum()) == 300
    assert bool(st["t2d"][kept].all())
    full = load_file(str(drafted[0] / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(st["lm_head.weight"], full[kept])  # row i = target id kept[i]
    assert torch.load(out / TOKEN_MAP, weights_only=True) == kept.tolist()  # what SGLang reads
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 300
    d = load_draft(out)
    assert d.kept_ids.tolist() == kept.tolist() and d.model.lm_head.weight.shape[0] == 300
    with pytest.raises(SpecError, match="already trimmed"):
        draft_trim(DraftTrimConfig(draft=out, target=str(tiny_dir), keep=300, output=tmp_path / "again"))
    # fp8ptq_trim.json is versioned and read back through validation: an edited one names file and field
    written = json.loads((out / TRIM_META).read_text())
    assert written["schema"] == "draft-trim" and read_json(out / TRIM_META, TrimSummary) == s
    del written["keep"]
    (out / TRIM_META).write_text(json.dumps(written))
    with pytest.raises(SpecError, match=r"fp8ptq_trim.json' is not a valid 'draft-trim' file: keep: Field required"):
        load_draft(out)


def test_draft_trim_refuses_a_permuted_tokenizer_of_the_same_size(tmp_path, drafted, tiny_dir):
    from fp8ptq.errors import ModelError

    draft = tmp_path / "draft"
    shutil.copytree(drafted[0], draft)
    tok = json.loads((draft / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[500:502]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other tokens
    (draft / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelError, match="have different tokenizers"):
        draft_trim(DraftTrimConfig(draft=draft, target=str(tiny_dir), keep=300, output=tmp_path / "t"))
    assert not (tmp_path / "t").exists()


def test_draft_commands_render_their_results(tmp_path, tiny_dir, drafted):
    """draft-train and draft-trim print their typed summaries: a table, or --json as the file holds it."""
    out = tmp_path / "d"
    small = ["--layers", "1", "--num-prompts", "3", "--gen-tokens", "6", "--gen-batch-size", "3"]
    r = _cli("draft-train", tiny_dir, "-o", out, *small, "--max-steps", "1", "--batch-size", "3", "--time-budget", "0")
    assert r.exit_code == 0, r.output
    assert "3 generations" in r.output and "1 (stopped by max_steps; resumed from 0)" in r.output
    saved = read_json(out / DRAFT_META, DraftSummary)
    assert saved.steps == 1 and saved.losses == () and saved.data.samples == 3
    r = _cli("draft-trim", drafted[0], "--target", tiny_dir, "--keep", "300", "-o", tmp_path / "t", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output) == json.loads((tmp_path / "t" / TRIM_META).read_text())
    r = _cli("draft-trim", drafted[0], "--target", tiny_dir, "--keep", "300", "-o", tmp_path / "t2")
    assert r.exit_code == 0 and "300 of 1024 ids" in r.output and "LM-head FLOPs saved" in r.output, r.output


def test_measure_loop_counts_like_vllm(tiny_dir, drafted):
    target, _ = load_target(tiny_dir)
    draft = load_draft(drafted[0])
    prompt = list(range(200, 230))
    stats = SpecStats(3)
    out = speculative_generate(target, draft, prompt, Decoding(gamma=3, max_tokens=20), stats=stats)
    assert len(out) == 20
    # greedy speculative output == the target's own greedy output
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(20):
            ids = torch.cat([ids, target.model(ids).logits[0, -1].argmax().view(1, 1)], 1)
    assert out == ids[0, len(prompt) :].tolist()
    # replayed on the target's greedy stream (as the vLLM test does with vLLM's output): the same counts
    with torch.inference_mode():
        for _ in range(4):
            ids = torch.cat([ids, target.model(ids).logits[0, -1].argmax().view(1, 1)], 1)
    replay = SpecStats(3)
    replay_greedy(draft, prompt, ids[0, len(prompt) :].tolist(), gamma=3, stats=replay, max_tokens=20)
    assert replay.summary() == stats.summary() and stats.accepted > 0
    s = stats.summary()
    assert s.drafted == 3 * s.drafts and s.accepted == sum(s.per_pos_accepted)
    assert all(a >= b for a, b in zip(s.per_pos_accepted, s.per_pos_accepted[1:]))
    assert s.emitted >= 19  # the first token comes from the prefill
    # the draft as its own target accepts everything
    self_stats = SpecStats(4)
    speculative_generate(draft, draft, prompt, Decoding(gamma=4, max_tokens=15, temperature=1.0), stats=self_stats)
    assert self_stats.summary().alpha == 1.0
    r, _ = measure_acceptance(target, draft, [prompt], AcceptancePlan((2,), 10, temperature=1.0, thresholds=(0.99,)))
    assert r.threshold_runs[0].drafted <= r.runs[0].drafted and r.threshold_runs[0].threshold == 0.99


def test_tau_standard_error_and_conditional_acceptance():
    """τ's standard error is a bootstrap over prompts; α given the previous position is accepted at i over
    accepted at i - 1."""
    same, mixed = SpecStats(2), SpecStats(2)
    for _ in range(4):  # every prompt alike: no spread
        for k, n in ((2, 2), (2, 1), (2, 0)):
            same.add(k, n)
        same.end_prompt()
    for n in (2, 0, 2, 0):  # half the prompts accept everything, half nothing
        for _ in range(3):
            mixed.add(2, n)
        mixed.end_prompt()
    s, m = same.summary(), mixed.summary()
    assert s.tau == pytest.approx(2.0) and s.tau_se == pytest.approx(0.0, abs=1e-12)
    assert m.tau == pytest.approx(2.0) and 0.3 < m.tau_se < 0.7  # τ 3 or 1 per prompt: s.e. ≈ 1/√4
    assert s.alpha_per_pos == pytest.approx([2 / 3, 1 / 3]) and s.alpha_conditional == pytest.approx([2 / 3, 0.5])
    assert mixed.prompts == [(9, 3), (3, 3), (9, 3), (3, 3)] and SpecStats(2).summary().tau_se is None
    assert m.per_prompt == [[9, 3], [3, 3], [9, 3], [3, 3]]


def test_paired_tau_difference_cancels_what_the_prompts_share():
    """Two proposers on the same prompts, one a bit better everywhere: the paired error is far below either
    run's own; mismatched prompt counts are refused."""
    from fp8ptq.spec.acceptance import paired_tau_difference

    a, b = SpecStats(2), SpecStats(2)
    for i in range(16):  # prompts from hard to easy, b accepts one more token on every 4th step (to 2 at most)
        for j in range(12):
            n = i % 3
            a.add(2, n)
            b.add(2, min(2, n + (j % 4 == 0)))
        a.end_prompt()
        b.end_prompt()
    sa, sb = a.summary(), b.summary()
    diff, se = paired_tau_difference(sa, sb)
    assert diff == pytest.approx(sb.tau - sa.tau) and diff > 0
    assert se < 0.5 * min(sa.tau_se, sb.tau_se) and diff > 3 * se
    c = SpecStats(2)
    c.add(2, 1)
    c.end_prompt()
    with pytest.raises(SpecError, match="same prompts"):
        paired_tau_difference(sa, c.summary())


def test_ngram_proposer_follows_vllms_rule():
    """vLLM's prompt lookup (its counters matched this rule exactly on real runs, BENCHMARKS.md)."""
    assert NgramDraft(1, 3).propose([1, 2, 3, 9, 1, 2, 3], 2) == [9, 1]  # longest suffix match [1, 2, 3]
    assert NgramDraft(1, 3).propose([1, 2, 3, 7, 3, 5, 2, 3], 1) == [7]  # length 2 beats the later length 1
    assert NgramDraft(1, 1).propose([5, 7, 5, 8, 5], 1) == [7]  # same length: the earliest occurrence
    assert NgramDraft(1, 2).propose([4, 4], 3) == [4]  # the match is near the end: fewer than k
    assert NgramDraft(2, 3).propose([1, 2, 3, 4], 2) == []  # nothing matches
    assert NgramDraft(2, 3).propose([1, 2, 3, 4, 1], 2) == []  # a 1-gram would match, but min is 2
    assert NgramDraft(1, 3).propose([1, 2, 3, 4, 1], 2) == [2, 3]
    assert NgramDraft(1, 1).propose([3], 2) == []  # the suffix itself is not an earlier occurrence
    assert parse_ngram("ngram") == NgramDraft(2, 4) and parse_ngram("ngram:1-5") == NgramDraft(1, 5)
    assert parse_ngram("out/draft") is None and parse_ngram("ngrams") is None
    with pytest.raises(SpecError, match="ngram:3-1"):
        parse_ngram("ngram:3-1")


def test_measure_and_recommend_ngram(tmp_path, tiny_dir):
    target, _ = load_target(tiny_dir)
    ngram = load_draft("ngram:1-3")
    prompt = list(range(200, 230)) + list(range(200, 210))
    stats = SpecStats(3)
    out = speculative_generate(target, ngram, prompt, Decoding(gamma=3, max_tokens=24), stats=stats)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(28):
            ids = torch.cat([ids, target.model(ids).logits[0, -1].argmax().view(1, 1)], 1)
    assert out == ids[0, len(prompt) : len(prompt) + 24].tolist()  # greedy output == the target's
    replay = SpecStats(3)
    replay_greedy(ngram, prompt, ids[0, len(prompt) :].tolist(), gamma=3, stats=replay, max_tokens=24)
    assert replay.summary() == stats.summary() and stats.drafts > 0
    assert "0" in stats.summary().k_hist or stats.drafts == stats.target_forwards  # steps may draft nothing
    sampled = SpecStats(3)  # T = 1: one-hot q, exact sampling still produces max_tokens tokens
    assert len(speculative_generate(target, ngram, prompt, Decoding(3, 12, temperature=1.0), stats=sampled)) == 12
    with pytest.raises(SpecError, match="thresholds"):
        measure_acceptance(target, ngram, [prompt], AcceptancePlan((2,), 4, thresholds=(0.5,)))
    rec = recommend(
        RecommendConfig(
            output=tmp_path / "rec",
            device_memory="1GiB",
            measure=MeasureConfig(
                target=str(tiny_dir), draft="ngram:1-3", gammas=(1, 2), num_prompts=2, max_tokens=8, cost_repeats=2
            ),
        )
    )
    cfg = json.loads((tmp_path / "rec" / "speculative_config.json").read_text())
    assert cfg == {
        "method": "ngram",
        "num_speculative_tokens": rec.gamma,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    flags = (tmp_path / "rec" / "sglang_flags.txt").read_text()
    depth = f"--speculative-ngram-max-trie-depth {3 + rec.gamma}"  # the longest match + the drafted tokens
    assert "--speculative-algorithm NGRAM" in flags and depth in flags
    assert rec.costs["c"] < 0.05 and rec.memory_plan["draft_weight_bytes"] == 0


def test_measure_and_recommend_suffix(tmp_path, tiny_dir):
    """vLLM's suffix decoding through arctic-inference's own suffix trees: greedy output equals the target's,
    the replay counts what the loop counted, T = 1 runs, and the recommendation writes vLLM's config (the
    cached-request count explicit) and no SGLang flags (SGLang 0.5.23 has no suffix decoding)."""
    from fp8ptq.spec.suffix import SuffixDraft, parse_suffix

    assert parse_suffix("suffix") == SuffixDraft() and parse_suffix("suffix:0").max_cached_requests == 0
    assert parse_suffix("ngram") is None and parse_suffix("suffixes") is None
    d = parse_suffix("suffix:0")  # the library's own search: the continuation of the longest suffix match
    rid = d.start([1, 2, 3, 4, 1, 2, 3])
    d.add(rid, [4])
    assert d.propose(rid, [1, 2, 3, 4, 1, 2, 3, 4], 3) == [1, 2, 3]
    shared = parse_suffix("suffix")  # one shared cache per pass over the prompts: a repeated prompt resets it
    shared.start([5, 6, 7])
    first = shared.cache
    shared.start([8, 9])
    assert shared.cache is first
    shared.start([5, 6, 7])
    assert shared.cache is not first
    target, _ = load_target(tiny_dir)
    suffix = load_any_draft("suffix:0", target)
    prompt = list(range(200, 230)) + list(range(200, 210))
    stats = SpecStats(3)
    out = speculative_generate(target, suffix, prompt, Decoding(gamma=3, max_tokens=24), stats=stats)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(28):
            ids = torch.cat([ids, target.model(ids).logits[0, -1].argmax().view(1, 1)], 1)
    assert out == ids[0, len(prompt) : len(prompt) + 24].tolist()  # greedy output == the target's
    replay = SpecStats(3)
    replay_greedy(
        load_any_draft("suffix:0", target), prompt, ids[0, len(prompt) :].tolist(), gamma=3, stats=replay, max_tokens=24
    )
    assert replay.summary() == stats.summary() and stats.drafts > 0
    sampled = SpecStats(3)
    assert len(speculative_generate(target, suffix, prompt, Decoding(3, 12, temperature=1.0), stats=sampled)) == 12
    rec = recommend(
        RecommendConfig(
            output=tmp_path / "rec",
            device_memory="1GiB",
            measure=MeasureConfig(
                target=str(tiny_dir), draft="suffix", gammas=(1, 2), num_prompts=2, max_tokens=8, cost_repeats=2
            ),
        )
    )
    cfg = json.loads((tmp_path / "rec" / "speculative_config.json").read_text())
    assert cfg == {
        "method": "suffix",
        "num_speculative_tokens": rec.gamma,
        "suffix_decoding_max_cached_requests": 10000,
    }
    assert (tmp_path / "rec" / "sglang_flags.txt").read_text() == "\n"
    assert rec.costs["c"] < 0.05 and rec.memory_plan["draft_weight_bytes"] == 0


def test_measure_and_recommend_files(tmp_path, tiny_dir, drafted):
    m = MeasureConfig(
        target=str(tiny_dir),
        draft=str(drafted[0]),
        gammas=(1, 2, 3),
        temperatures=(0.0, 1.0),
        num_prompts=2,
        max_tokens=8,
        cost_repeats=2,
        thresholds=(0.5,),
    )
    result = measure(m)
    assert set(result.by_temperature) == {"0.0", "1.0"}
    assert [r.gamma for r in result.by_temperature["0.0"].runs] == [1, 2, 3]
    assert set(result.costs["t_verify_s"]) == {"1", "2", "3", "4"}
    saved = tmp_path / "m.json"
    saved.write_text(json.dumps(to_json(result)))
    assert read_measurement(saved) == result  # what --save writes reads back typed and equal
    rec = recommend(
        RecommendConfig(
            output=tmp_path / "rec", measured=saved, temperature=1.0, device_memory="1GiB", token_map="tm.pt"
        )
    )
    cfg = json.loads((tmp_path / "rec" / "speculative_config.json").read_text())
    assert cfg == {"method": "draft_model", "model": str(drafted[0]), "num_speculative_tokens": rec.gamma}
    assert "--speculative-token-map" not in (tmp_path / "rec" / "sglang_flags.txt").read_text()  # SGLang 0.5.23
    assert rec.token_map == "tm.pt"  # recorded, not served
    from fp8ptq.results import read_json
    from fp8ptq.spec.recommend import RecommendReport

    assert read_json(tmp_path / "rec" / "recommendation.json", RecommendReport) == rec  # the file is the result
    assert (tmp_path / "rec" / "speculative.png").stat().st_size > 1000
    assert rec.memory_plan["fits_spec"] and rec.memory_plan["draft_weight_bytes"] > 0
    with pytest.raises(SpecError, match="temperature 0.5 was not measured"):
        recommend(RecommendConfig(output=tmp_path / "rec2", measured=saved, temperature=0.5))
    with pytest.raises(SpecError, match="memory size"):
        recommend(RecommendConfig(output=tmp_path / "rec3", measured=saved, device_memory="lots"))
    # a file with a renamed key fails at once, naming the file and the field (not a KeyError mid-way)
    bad = json.loads(saved.read_text())
    bad["by_temperature"]["1.0"]["runs"][0]["t"] = bad["by_temperature"]["1.0"]["runs"][0].pop("tau")
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(SpecError, match=r"bad.json' is not a valid 'spec-measure' file: by_temperature.1.0.runs.0.tau"):
        recommend(RecommendConfig(output=tmp_path / "rec4", measured=tmp_path / "bad.json", temperature=1.0))
    assert not (tmp_path / "rec4").exists()


def test_build_draft_bundle(tmp_path, tiny_dir):
    from fp8ptq.draft.auto import DraftBundleConfig, build_draft_bundle

    out = tmp_path / "bundle"
    settings = DraftBundleConfig(
        layers=1,
        max_steps=2,
        time_budget_s=None,
        trim_keep=200,
        gammas=(1, 2),
        num_prompts=2,
        max_tokens=6,
        train=dict(SMALL),
    )
    s = build_draft_bundle(tiny_dir, out, settings)
    assert (out / "draft" / "config.json").is_file() and (out / "draft-trimmed" / TOKEN_MAP).is_file()
    assert json.loads((out / "speculative_config.json").read_text()) == s.speculative_config
    assert s.speculative_config["model"] == "draft" and s.recommendation.gamma in (1, 2)
    assert "--speculative-token-map" not in (out / "sglang_flags.txt").read_text()  # the full draft, no map
    written = json.loads((out / "speculative" / "recommendation.json").read_text())
    assert written["token_map"] == f"draft-trimmed/{TOKEN_MAP}"  # recorded beside the trimmed draft
    assert s.trimmed["schema"] == "draft-trim" and s.draft["schema"] == "draft-train"


# ---------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("vocab") / "m"
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    return d


def _cli(*args):
    from fp8ptq.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_errors(tmp_path, tiny_dir, drafted, other_vocab):
    r = _cli("spec", "measure", tiny_dir, other_vocab, "--gammas", "1")
    assert r.exit_code == 2 and "draft vocabulary size 1000 != target vocabulary size 1024" in r.output
    r = _cli("spec", "measure", tiny_dir, drafted[0], "--gammas", "0-3")
    assert r.exit_code == 2 and "must be in 1..16" in r.output
    r = _cli("spec", "measure", tmp_path / "nope", drafted[0])
    assert r.exit_code == 2 and "not found" in r.output
    r = _cli("spec", "memory", tiny_dir, "--device-memory", "24 parsecs")
    assert r.exit_code == 2 and "cannot read the memory size" in r.output
    r = _cli("draft-train", tiny_dir, "-o", tmp_path / "d", "--layers", "9")
    assert r.exit_code == 2 and "--layers 9 is out of range" in r.output
    r = _cli("draft-trim", drafted[0], "--target", other_vocab, "--keep", "10", "-o", tmp_path / "t")
    assert r.exit_code == 2 and "1000" in r.output and "1024" in r.output
    for flags, said in ((["--draft", "bogus"], "unknown --draft 'bogus'"), (["--draft-trim", "0"], "--draft-trim 0")):
        r = _cli("quantize", tiny_dir, "-r", "fp8-dynamic", "-o", tmp_path / "q", "--draft", "auto", *flags)
        assert r.exit_code == 2 and said in r.output and not (tmp_path / "q").exists(), r.output
    r = _cli("spec", "recommend", "-o", tmp_path / "r")
    assert r.exit_code == 2 and "needs TARGET and DRAFT" in r.output
    # --engine-check refuses before minutes of measuring: no vLLM venv there, or a trimmed draft
    r = _cli(
        "spec",
        "recommend",
        tiny_dir,
        drafted[0],
        "-o",
        tmp_path / "r",
        "--engine-check",
        "--vllm-python",
        tmp_path / "no-venv" / "python",
    )
    assert r.exit_code == 2 and "--engine-check needs vLLM" in r.output and "no-venv" in r.output, r.output
    assert not (tmp_path / "r").exists()
    trimmed = tmp_path / "trimmed"
    shutil.copytree(drafted[0], trimmed)
    (trimmed / TRIM_META).write_text("{}")
    r = _cli("spec", "recommend", tiny_dir, trimmed, "-o", tmp_path / "r", "--engine-check")
    assert r.exit_code == 2 and "vocabulary-trimmed draft" in r.output, r.output


def test_cli_memory_and_measure_json(tiny_dir, drafted):
    r = _cli("spec", "memory", tiny_dir, drafted[0], "--device-memory", "1GiB", "--context", "512", "--json")
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)
    assert p["fits_spec"] and p["max_batch_spec"] <= p["max_batch_plain"]
    r = _cli("spec", "memory", tiny_dir, "ngram", "--device-memory", "1GiB", "--context", "512", "--json")
    assert r.exit_code == 0, r.output  # a proposer without draft weights (was: "ngram" read as a model path)
    assert json.loads(r.stdout)["draft_weight_bytes"] == 0
    r = _cli(
        "spec", "measure", tiny_dir, drafted[0], "--gammas", "1,2", "--num-prompts", "1", "--max-tokens", "6", "--json"
    )
    assert r.exit_code == 0, r.output
    assert [x["gamma"] for x in json.loads(r.stdout)["by_temperature"]["0.0"]["runs"]] == [1, 2]


def test_quantize_draft_auto_bundles_target_draft_and_config(tmp_path, tiny_dir):
    """`quantize --draft auto`: quantized target + draft + measured config in one folder, in the report."""
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.draft.auto import DraftBundleConfig

    out = tmp_path / "q"
    m = quantize(
        QuantizeConfig(
            model=str(tiny_dir),
            recipe="fp8-dynamic",
            output=out,
            eval_samples=0,
            draft=DraftBundleConfig(max_steps=3, time_budget_s=30, device_memory="1GiB"),
        )
    )
    spec = m.speculative
    # the memory plan sizes the bundle's draft, not a "draft" folder in the working directory (it did)
    plan = json.loads((out / "speculative" / "recommendation.json").read_text())["memory_plan"]
    assert plan["draft_weight_bytes"] > 0
    assert spec.speculative_config["method"] == "draft_model" and spec.speculative_config["model"] == "draft"
    assert json.loads((out / "speculative_config.json").read_text()) == spec.speculative_config
    assert (out / "draft" / "config.json").is_file() and (out / "sglang_flags.txt").is_file()
    assert 1 <= spec.recommendation.gamma <= 8
    report = (out / "report.md").read_text()
    assert f'"model": "{out}/draft"' in report and "--speculative-config" in report


def test_generate_data_without_logits_gives_the_same_tokens(tiny_dir):
    """topk 0 (the EAGLE-3 trainer) keeps no logits; the greedy and the sampled batches are unchanged."""
    from fp8ptq.draft.train import Generation, generate_data
    from fp8ptq.spec.prompts import builtin_prompts, encode_prompts

    target, src = load_target(str(tiny_dir), "cpu")
    tok = src.tokenizer()
    prompts = encode_prompts(tok, builtin_prompts("calibration", 4), max_tokens=24)
    runs = [generate_data(target, tok, prompts, Generation(gen_tokens=6, batch_size=2, topk=k, seed=3)) for k in (2, 0)]
    for key in ("tokens", "prompt_len", "gen_len"):
        assert torch.equal(runs[0][key], runs[1][key]), key
    assert runs[1]["topk_ids"].shape == (4, 6, 0) and runs[0]["topk_logp"][0, 0, 0] > -30


def test_quantize_refuses_an_unknown_draft_kind_before_any_work(tmp_path, tiny_dir):
    """The library's QuantizeConfig(draft=DraftBundleConfig(...)) is checked with the other options, before
    the model is read (the command's --draft values are checked when it builds the object)."""
    from fp8ptq.api import QuantizeConfig, quantize
    from fp8ptq.draft.auto import DraftBundleConfig
    from fp8ptq.errors import RecipeError

    bad = DraftBundleConfig(kind="bogus")
    with pytest.raises(RecipeError, match="unknown draft kind 'bogus'"):
        quantize(QuantizeConfig(model=str(tiny_dir), recipe="fp8-dynamic", output=tmp_path / "q", draft=bad))
    assert not (tmp_path / "q").exists()


def test_spec_compare_decides_between_proposers(tmp_path, tiny_dir):
    """`spec compare`: each proposer recommended in its own folder on the same target and prompts, the
    decision the highest predicted speedup (none above 1: no speculation), the winner's configs in OUT."""
    from typer.testing import CliRunner

    from fp8ptq.cli import app

    out = tmp_path / "cmp"
    args = ["spec", "compare", str(tiny_dir), "ngram:1-3", "suffix:0", "-o", str(out), "--gammas", "1,2"]
    r = CliRunner().invoke(app, args + ["--num-prompts", "2", "--max-tokens", "8", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "comparison.json").read_text())
    assert rep["schema"] == "spec-compare" and rep["basis"] == "predicted"
    rows = {p["draft"]: p for p in rep["proposers"]}
    assert [p["method"] for p in rep["proposers"]] == ["ngram", "suffix"]
    best = max(rows.values(), key=lambda p: p["predicted_speedup"])
    for p in rows.values():  # each proposer's own recommendation, as `spec recommend` writes it
        own = json.loads((out / p["folder"] / "recommendation.json").read_text())
        assert own["gamma"] == p["gamma"] and own["speedup"] == p["predicted_speedup"]
    if best["predicted_speedup"] > 1.0:
        assert rep["chosen"] == best["draft"] and best["draft"] in rep["why"]
        want = (out / best["folder"] / "speculative_config.json").read_text()
        assert (out / "speculative_config.json").read_text() == want
    else:
        assert rep["chosen"] is None and "without speculation" in rep["why"]
        assert not (out / "speculative_config.json").exists()
    again = tmp_path / "rec"  # `spec recommend --compare`: the same comparison (its costs re-measured)
    r = CliRunner().invoke(
        app,
        ["spec", "recommend", str(tiny_dir), "ngram:1-3", "--compare", "suffix:0", "-o", str(again), "--gammas", "1,2"]
        + ["--num-prompts", "2", "--max-tokens", "8", "--json"],
    )
    assert r.exit_code == 0, r.output
    rep2 = json.loads(r.stdout)
    top = max(rep2["proposers"], key=lambda p: p["predicted_speedup"])
    assert rep2["chosen"] == (top["draft"] if top["predicted_speedup"] > 1.0 else None), rep2
    assert [p["draft"] for p in rep2["proposers"]] == ["ngram:1-3", "suffix:0"]
    assert (again / "1-suffix" / "recommendation.json").is_file()
    bad = CliRunner().invoke(app, ["spec", "compare", str(tiny_dir), "suffix", "-o", str(tmp_path / "one")])
    assert bad.exit_code == 2 and "two or more different drafts" in bad.output, bad.output
    assert not (tmp_path / "one").exists()


def test_measure_and_recommend_gamma_per_batch_size(tmp_path, tiny_dir, drafted):
    """--batch-sizes: the costs timed again with 4 rows (target and draft batched), batch 1's being the plain
    costs; the recommendation has a γ per batch size and the vLLM config carries the schedule exactly when γ
    changes with the batch (recommend.with_schedule); the measurement reads back typed and equal."""
    from fp8ptq.spec.recommend import vllm_config, with_schedule

    m = MeasureConfig(
        target=str(tiny_dir), draft=str(drafted[0]), gammas=(1, 2), num_prompts=1, max_tokens=6, cost_repeats=2
    )
    result = measure(replace(m, batch_sizes=(4,)))
    assert set(result.costs_by_batch) == {"1", "4"} and result.costs_by_batch["1"] == result.costs
    assert "batch 4" in result.costs_by_batch["4"]["source"] and result.costs_by_batch["4"]["t_draft_s"] > 0
    saved = tmp_path / "m.json"
    saved.write_text(json.dumps(to_json(result)))
    assert read_measurement(saved) == result
    rec = recommend(RecommendConfig(output=tmp_path / "rec", measured=saved))
    assert [r["batch"] for r in rec.per_batch] == [1, 4] and rec.batch_schedule[0][0] == 1
    assert rec.per_batch[0]["gamma"] == (rec.gamma if rec.worth_it else 0)
    cfg = json.loads((tmp_path / "rec" / "speculative_config.json").read_text())
    assert cfg == with_schedule(vllm_config(str(drafted[0]), rec.gamma), rec.batch_schedule)
    with pytest.raises(SpecError, match="must be ≥ 1"):
        measure(replace(m, batch_sizes=(0,)))
