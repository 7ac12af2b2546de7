"""EAGLE-3 heads on tiny random Llamas: the head's forward against a step-by-step reference, the vLLM
checkpoint layout, the training-time-test mask, training (loss goes down, resume), and the harness."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from fp8ptq.draft.eagle3_loss import ttt_mask
from fp8ptq.draft.eagle3_train import Eagle3Summary, Eagle3TrainConfig, eagle3_train
from fp8ptq.draft.eagle3_warm import linear_warm_start
from fp8ptq.results import read_json
from fp8ptq.spec import SpecError
from fp8ptq.spec.eagle3 import ARCH, EAGLE3_META, build_head, default_layer_ids, is_eagle3, load_head
from fp8ptq.spec.eagle3_loop import AuxCapture, Eagle3Draft
from fp8ptq.spec.measure import Decoding, SpecStats, plain_generate, replay_greedy, speculative_generate
from fp8ptq.spec.models import load_target

pytestmark = pytest.mark.tiny

SMALL = dict(num_prompts=6, gen_tokens=12, gen_batch_size=3, batch_size=3, plain_texts=2, checkpoint_every=2)


@pytest.fixture(scope="module")
def target4(tiny_model):
    return tiny_model("llama", layers=4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target4):
    out = tmp_path_factory.mktemp("eagle3") / "head"
    cfg = Eagle3TrainConfig(
        target=str(target4), output=out, draft_vocab=256, max_steps=12, time_budget_s=None, lr=3e-3, **SMALL
    )
    return out, eagle3_train(cfg)


def test_export_layout_is_vllms(trained, target4):
    out, meta = trained
    cfg = json.loads((out / "config.json").read_text())
    tcfg = json.loads((target4 / "config.json").read_text())
    assert cfg["architectures"] == [ARCH] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 256 and cfg["vocab_size"] == tcfg["vocab_size"]
    assert cfg["target_hidden_size"] == tcfg["hidden_size"]
    assert default_layer_ids(4) == [2, 2, 1]  # vLLM sorts and de-duplicates them: the export says so
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2]  # vLLM's: the inputs of layers 1 and 2
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1]  # SGLang's: it adds one for Llama
    t = load_file(str(out / "model.safetensors"))
    H = tcfg["hidden_size"]
    heads, kv = tcfg["num_attention_heads"], tcfg["num_key_value_heads"]
    hd = H // heads
    assert t["fc.weight"].shape == (H, 2 * H)  # two distinct ids here: [2, 4 // 2, 4 - 3] = {1, 2}
    assert t["midlayer.self_attn.q_proj.weight"].shape == (heads * hd, 2 * H)
    assert t["midlayer.self_attn.k_proj.weight"].shape == (kv * hd, 2 * H)
    assert t["midlayer.hidden_norm.weight"].shape == (H,) and t["norm.weight"].shape == (H,)
    assert t["lm_head.weight"].shape == (256, H)
    assert cfg["fc_norm"] is True and t["fc_norm.0.weight"].shape == t["fc_norm.1.weight"].shape == (H,)
    assert meta.warm_start["tokens"] > 0
    assert "embed_tokens.weight" not in t  # vLLM shares the target's embedding
    kept = torch.arange(256) + t["d2t"]
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert torch.equal(t["t2d"].nonzero().flatten(), kept) and bool((kept.diff() > 0).all())
    assert meta.loss_last < meta.loss_first
    saved = read_json(out / EAGLE3_META, Eagle3Summary)  # the file, versioned and validated
    assert saved == replace(meta, losses=()) and saved.data.tokens > 0
    assert is_eagle3(out) and not is_eagle3(target4)


def test_layer_ids_out_of_range(tmp_path, target4):
    with pytest.raises(SpecError, match="out of range"):
        eagle3_train(Eagle3TrainConfig(target=str(target4), output=tmp_path / "o", layer_ids=(1, 9), **SMALL))
    assert not (tmp_path / "o").exists()


def test_ttt_mask():
    m = ttt_mask(4, 2, "cpu")  # query i of step 2: step-0 keys j ≤ i-2, step-1 key i-1, step-2 key i
    assert m.shape == (4, 12)
    assert m[3].tolist() == [True, True, False, False] + [False, False, True, False] + [False, False, False, True]
    assert m[0].tolist()[:4] == [False] * 4 and bool(m[0, 8])


def test_block_with_cache_equals_full_forward(target4):
    """Causal attention over a cached prefix equals one forward over the whole block."""
    target, _ = load_target(str(target4))
    head = build_head(target.model, [1, 2], 300).eval()
    torch.manual_seed(1)
    T, H = 7, head.s.hidden
    toks, hid, pos = torch.randint(0, 300, (1, T)), torch.randn(1, T, H), torch.arange(T)
    with torch.no_grad():
        out, logits, _ = head.block(toks, hid, pos)
        o1, _, kv = head.block(toks[:, :4], hid[:, :4], pos[:4])
        o2, l2, _ = head.block(toks[:, 4:], hid[:, 4:], pos[4:], kv)
    torch.testing.assert_close(torch.cat([o1, o2], 1), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l2, logits[:, 4:], atol=1e-5, rtol=1e-5)


def test_aux_capture_is_the_residual_stream(target4):
    """Layer id 0 is the embedding (vLLM: the input of layer 0), id i the input of layer i."""
    target, _ = load_target(str(target4))
    ids = torch.tensor([[5, 6, 7, 8]])
    with AuxCapture(target.model, [0, 2]) as cap, torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
        aux = cap.take()
    H = target.model.config.hidden_size
    torch.testing.assert_close(aux[..., :H], target.model.get_input_embeddings()(ids).float())
    torch.testing.assert_close(aux[..., H:], out.hidden_states[2].float())


def test_greedy_speculative_equals_plain_and_replay_matches(trained, target4):
    out, _ = trained
    target, src = load_target(str(target4))
    draft = Eagle3Draft(load_head(out, target.model), str(out))
    prompt = src.tokenizer()("def main():", add_special_tokens=False)["input_ids"]
    plain = plain_generate(target, prompt, max_tokens=20)
    stats = SpecStats(3)
    spec = speculative_generate(  # the one loop, over proposers.Eagle3Proposer
        target,
        draft,
        prompt,
        Decoding(gamma=3, max_tokens=20, temperature=0.0, threshold=None, device="cpu"),
        generator=None,
        stats=stats,
    )
    assert spec == plain  # greedy speculative decoding never changes the output
    replayed = SpecStats(3)
    longer = plain_generate(target, prompt, max_tokens=24)
    replay_greedy(draft, prompt, longer, gamma=3, stats=replayed, max_tokens=20, target=target)
    assert (replayed.drafted, replayed.accepted) == (stats.drafted, stats.accepted)
    assert stats.per_pos == replayed.per_pos
    # the costs of a decode batch (spec recommend --batch-sizes): target and head timed over 3 rows at once
    from fp8ptq.spec.measure import measure_costs

    batched = measure_costs(target, draft, prompt * 4, max_k=3, repeats=2, batch=3)
    assert batched.t_draft > 0 and set(batched.t_verify) == {1, 2, 3} and "batch 3" in batched.source


def test_resume_continues(tmp_path, target4):
    base = dict(target=str(target4), draft_vocab=0, max_steps=4, keep_work=True, **SMALL)
    first = eagle3_train(Eagle3TrainConfig(output=tmp_path / "a", time_budget_s=0.0, **base))
    assert first.steps == 1 and first.stopped_by == "time_budget"
    second = eagle3_train(
        Eagle3TrainConfig(output=tmp_path / "a", time_budget_s=None, resume=True, overwrite=True, **base)
    )
    assert second.resumed_from == 1 and second.steps == 4 and "generate_s" not in second.timings
    assert "d2t" not in load_file(str(tmp_path / "a" / "model.safetensors"))  # full vocabulary: no map
    # a trimmed head on the same work dir reuses its generations and hidden states, not the other head
    third = eagle3_train(
        Eagle3TrainConfig(
            output=tmp_path / "a", time_budget_s=None, resume=True, overwrite=True, **(base | {"draft_vocab": 64})
        )
    )
    assert third.resumed_from == 0 and third.steps == 4 and "capture_s" not in third.timings
    assert load_file(str(tmp_path / "a" / "model.safetensors"))["d2t"].shape == (64,)


def test_a_capture_cut_short_keeps_the_generations(tmp_path, target4, monkeypatch):
    """The generations (the slowest data) survive an interrupted capture: the rerun captures again from them."""
    import fp8ptq.draft.eagle3_train as e3

    cfg = Eagle3TrainConfig(target=str(target4), output=tmp_path / "o", draft_vocab=0, max_steps=1, **SMALL)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(e3, "capture", killed)
    with pytest.raises(KeyboardInterrupt):
        eagle3_train(cfg)
    monkeypatch.undo()
    again = eagle3_train(replace(cfg, resume=True))
    assert "generate_s" not in again.timings and again.timings["capture_s"] > 0 and again.steps == 1


@pytest.mark.parametrize(
    "extra, phrase",
    [
        (["--kind", "bogus"], "unknown --kind"),
        (["--kind", "eagle3", "--layer-ids", "2,x"], "--layer-ids"),
        (["--kind", "eagle3", "--aux-noise", "-0.1"], "aux_noise=-0.1"),
        (["--kind", "eagle3", "--feature-loss", "nan"], "feature_loss=nan"),
        (["--kind", "eagle3", "--generator", "bogus"], "generator 'bogus'"),
    ],
)
def test_cli_bad_input_is_one_line(tmp_path, target4, extra, phrase):
    from typer.testing import CliRunner

    from fp8ptq.cli import app

    r = CliRunner().invoke(app, ["draft-train", str(target4), "-o", str(tmp_path / "o"), *extra])
    assert r.exit_code == 2, r.output
    assert phrase in r.output and "fix:" in r.output and len(r.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_draft_bundle_eagle3_writes_head_and_eagle3_configs(tmp_path, target4):
    """`quantize --draft eagle3` (draft.auto.build_draft_bundle(kind="eagle3")): the head in draft/, trimmed to
    --draft-trim rows, and configs that say method eagle3 (vLLM) / EAGLE3 (SGLang) for the relative path."""
    from fp8ptq.draft.auto import DraftBundleConfig, build_draft_bundle

    out = tmp_path / "bundle"
    s = build_draft_bundle(
        target4, out, DraftBundleConfig(kind="eagle3", trim_keep=256, max_steps=2, time_budget_s=None, gammas=(1, 2),
        num_prompts=2, max_tokens=6, train=dict(SMALL)),
    )  # fmt: skip
    assert s.kind == "eagle3" and s.trimmed is None and s.draft["steps"] == 2 and s.draft["schema"] == "eagle3-train"
    gamma = s.recommendation.gamma
    assert s.speculative_config == {"method": "eagle3", "model": "draft", "num_speculative_tokens": gamma}
    assert json.loads((out / "speculative_config.json").read_text()) == s.speculative_config
    assert is_eagle3(out / "draft") and not (out / "draft-trimmed").exists()
    assert json.loads((out / "draft" / "config.json").read_text())["draft_vocab_size"] == 256
    flags = (out / "sglang_flags.txt").read_text().split()
    assert flags[flags.index("--speculative-algorithm") + 1] == "EAGLE3" and "--speculative-token-map" not in flags
    with pytest.raises(SpecError, match="unknown draft kind"):
        build_draft_bundle(target4, tmp_path / "x", DraftBundleConfig(kind="medusa"))
    assert not (tmp_path / "x").exists()


def test_head_reads_lm_rows_through_the_targets_final_norm(target4):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target4))
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    head = build_head(model, [1, 2], 256)
    assert torch.equal(head.norm.weight, model.model.norm.weight.float())
    assert torch.equal(head.midlayer.hidden_norm.weight, torch.ones_like(head.midlayer.hidden_norm.weight))

    model.config.model_type = "gemma3_text"  # Gemma's norm computes (1 + weight) · x / rms(x): not copied
    assert torch.equal(build_head(model, [1, 2], 256).norm.weight, torch.ones(model.config.hidden_size))
    model.config.model_type = "not-a-family"  # no adapter: the generic path probes the norm (w, not 1 + w)
    assert torch.equal(build_head(model, [1, 2], 256).norm.weight, model.model.norm.weight.float())


def test_capture_records_what_the_lm_head_reads_and_the_teacher_is_the_targets(tmp_path, target4, monkeypatch):
    """The capture pass (LM head over the last position only) stores the final norm's output; through the
    target's LM-head rows of the kept ids it gives the target's own distribution renormalised over them."""
    from fp8ptq.draft.eagle3_data import Sequence, ShardStore, capture
    from fp8ptq.draft.eagle3_loss import Teacher

    target, _ = load_target(str(target4))
    seqs = [Sequence([5, 6, 7, 8, 9, 10], 0), Sequence([11, 12, 13], 1), Sequence(list(range(20, 29)), 2)]
    assert capture(target, seqs, [1, 2], tmp_path, batch=2, device="cpu") == 18  # tokens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    store = ShardStore(tmp_path, 2)
    assert sorted(store.lengths()) == [3, 6, 9] and sorted(store.loss_from) == [0, 1, 2]
    i = store.lengths().index(9)
    batch = store.batch([i])
    kept = torch.arange(0, 300, 3)
    with torch.no_grad():
        logits = target.model(input_ids=torch.tensor([list(range(20, 29))])).logits[0].float()
    teacher = Teacher(target.model.get_output_embeddings().weight[kept].detach())
    want = torch.log_softmax(logits[:, kept], -1)
    torch.testing.assert_close(teacher.log_probs(batch["normed"][0]), want, atol=2e-2, rtol=0)  # fp16 storage
    assert store.loss_from[i] == 2 and torch.equal(batch["ids"][0], torch.arange(20, 29))
    # a model whose final norm fp8ptq cannot name: the LM head's own input, over every position
    import fp8ptq.models.arch as arch
    from fp8ptq.errors import ModelError

    def unreadable(config):
        raise ModelError("no adapter")

    monkeypatch.setattr(arch, "arch_for", unreadable)
    (tmp_path / "b").mkdir()
    assert capture(target, seqs, [1, 2], tmp_path / "b", batch=2, device="cpu") == 18
    assert torch.equal(ShardStore(tmp_path / "b", 2).batch([i])["normed"], batch["normed"])


def test_batches_cover_every_sequence_each_epoch_with_similar_lengths():
    from fp8ptq.draft.eagle3_data import BatchPlan, epoch_batches
    from fp8ptq.draft.eagle3_loss import loss_rows

    lengths = [10 + (i * 37) % 300 for i in range(200)]
    plan = BatchPlan(lengths, 8, seed=1)
    first = [plan(s) for s in range(plan.per_epoch)]
    assert sorted(i for b in first for i in b) == list(range(200))
    assert epoch_batches(lengths, 8, 1, 0) == first and plan(plan.per_epoch) != first[0]  # next epoch: new order
    padded = sum(8 * max(lengths[i] for i in b) for b in first)
    assert padded < 1.15 * sum(lengths)  # similar lengths together (a random batch: ~1.8x)
    rows = loss_rows(torch.tensor([6, 5]), torch.tensor([0, 2]), 6)
    assert rows.tolist() == [[True] * 4 + [False] * 2, [False, False, True, False, False, False]]


def test_regularisers_noise_relative_to_each_layer_and_feature_term(tmp_path, target4):
    """aux_noise: each aux layer's noise is σ times that layer's RMS at the position (one layer 1000x the
    other's scale keeps the same relative noise), the same for the same (seed, step), another for the next
    step; feature_loss adds a non-negative term that is 0 when the weight is 0."""
    from fp8ptq.draft.eagle3_data import Sequence, ShardStore, capture
    from fp8ptq.draft.eagle3_loss import Objective, Teacher, noisy, ttt_loss

    aux = torch.cat([torch.randn(2, 50, 64), 1000 * torch.randn(2, 50, 64)], -1)
    gen = torch.Generator().manual_seed(3)
    delta = (noisy(aux, 2, 0.1, gen) - aux).unflatten(-1, (2, -1))
    rel = delta.pow(2).mean(-1).sqrt() / aux.unflatten(-1, (2, -1)).pow(2).mean(-1).sqrt()
    assert 0.08 < float(rel.mean()) < 0.12 and float(rel[..., 0].mean() / rel[..., 1].mean()) == pytest.approx(1, 0.1)
    assert noisy(aux, 2, 0.0, None) is aux

    target, _ = load_target(str(target4))
    seqs = [Sequence(list(range(5, 17)), 2), Sequence(list(range(30, 40)), 1)]
    capture(target, seqs, [1, 2], tmp_path, batch=2, device="cpu")
    batch = ShardStore(tmp_path, 1).batch([0, 1])
    head = build_head(target.model, [1, 2], 300, fc_norm=True)
    teacher = Teacher(target.model.get_output_embeddings().weight[:300].detach())
    with torch.no_grad():
        plain = ttt_loss(head, batch, Objective(2), teacher, "cpu")
        assert torch.equal(ttt_loss(head, batch, Objective(2, feature_loss=0.0), teacher, "cpu", step=5), plain)
        feat = ttt_loss(head, batch, Objective(2, feature_loss=1.0), teacher, "cpu")
        a, b = (ttt_loss(head, batch, Objective(2, aux_noise=0.5), teacher, "cpu", step=s) for s in (7, 7))
        c = ttt_loss(head, batch, Objective(2, aux_noise=0.5), teacher, "cpu", step=8)
    assert float(feat) > float(plain) > 0
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, plain)


def test_lr_decays_by_whichever_bound_ends_the_run():
    from types import SimpleNamespace

    from fp8ptq.draft.loop import lr_at

    cfg = SimpleNamespace(lr=1.0, warmup_steps=10, max_steps=1000, time_budget_s=None)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(1000, cfg) == pytest.approx(0.1) and lr_at(505, cfg, 1e9) == pytest.approx(0.55)
    timed = SimpleNamespace(lr=1.0, warmup_steps=10, max_steps=1000, time_budget_s=100.0)
    assert lr_at(20, timed, 0.0) == pytest.approx(lr_at(20, cfg))  # steps bind: as before
    assert lr_at(20, timed, 50.0) == pytest.approx(0.55)  # half the budget spent: the cosine's midpoint
    assert lr_at(20, timed, 100.0) == pytest.approx(0.1)  # budget spent: the floor
    assert lr_at(5, timed, 99.0) == pytest.approx(0.6)  # warm-up is by steps
    # a warm-up that took 60 s of the 100: the cosine spans the 40 s after it, not the budget from zero
    assert lr_at(10, timed, 60.0, warm_s=60.0) == pytest.approx(1.0) and lr_at(10, timed, 60.0) < 0.42
    assert lr_at(30, timed, 80.0, warm_s=60.0) == pytest.approx(0.55)


def test_linear_warm_start_recovers_a_linear_target(tmp_path, target4):
    """Shards whose next-position feature is an exact linear map of the (per-layer normalised) aux states:
    the warm start finds that map, zeroes the attention and MLP outputs, and the head's logits are then the
    target LM-head rows over norm(fc(...))."""
    from safetensors.torch import save_file

    target, _ = load_target(str(target4))
    head = build_head(target.model, [1, 2], 256, fc_norm=True)
    with torch.no_grad():
        head.fc_norm[1].weight.uniform_(0.5, 2.0)
    H = head.s.hidden
    g = torch.Generator().manual_seed(3)
    w_true = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
    for s in range(3):
        aux = torch.randn(4, 40, 2 * H, generator=g)
        aux[..., 7] *= 300.0  # a massive channel, as real residual streams have
        aux = aux.bfloat16().float()
        with torch.no_grad():
            y = head.fc_input(aux) @ w_true.T
        final = torch.cat([torch.zeros(4, 1, H), y[:, :-1]], 1)  # final[i + 1] = f(aux[i])
        lens = torch.tensor([40, 33, 40, 12])
        save_file({"aux": aux.bfloat16(), "final": final, "lens": lens}, str(tmp_path / f"shard-{s:05d}.safetensors"))
    fit = linear_warm_start(head, tmp_path, 3, seed=0, embed=False, ridge=1e-9)
    assert fit["tokens"] == 3 * (39 + 32 + 39 + 11) and fit["r2"] > 0.9999, fit
    torch.testing.assert_close(head.fc.weight, w_true, atol=2e-3, rtol=0)
    assert not head.midlayer.self_attn.o_proj.weight.any() and not head.midlayer.mlp.down_proj.weight.any()
    toks, aux = torch.randint(0, 300, (1, 5)), torch.randn(1, 5, 2 * H)
    with torch.no_grad():
        hid = head.fuse(aux)
        out, logits, _ = head.block(toks, hid, torch.arange(5))
        torch.testing.assert_close(out, hid)  # both branches start at zero: the head is the linear predictor
        torch.testing.assert_close(logits, head.lm_head(head.norm(hid)))
    (tmp_path / "shard-00000.safetensors").unlink()
    old = {"aux": aux.bfloat16(), "lens": torch.tensor([5]), "ids": toks}  # a capture from before `final`
    save_file(old, str(tmp_path / "shard-00000.safetensors"))
    with pytest.raises(SpecError, match="final feature"):
        linear_warm_start(head, tmp_path, 1, seed=0)


def test_warm_start_embedding_path_is_a_same_token_attention(tmp_path, target4):
    """With the embedding term, the next token's contribution B · n(e) goes through attention: v/o_proj hold
    B's factorisation (B of rank ≤ kv_heads · head_dim is recovered exactly) and q/k make each position
    attend to its own token, so on a sequence of distinct tokens the head's output is ≈ fc(...) + B · n(e)."""
    from safetensors.torch import save_file

    target, _ = load_target(str(target4))
    head = build_head(target.model, [1, 2], 256, fc_norm=True)
    s, H = head.s, head.s.hidden
    r = min(H, s.kv_heads * s.head_dim)
    g = torch.Generator().manual_seed(4)
    w_true = torch.randn(H, 2 * H, generator=g) / (2 * H) ** 0.5
    b_true = (torch.randn(H, r, generator=g) @ torch.randn(r, H, generator=g)) / H
    kept = head.draft_to_target(torch.arange(256))
    for i in range(3):
        aux = torch.randn(4, 40, 2 * H, generator=g).bfloat16().float()
        ids = kept[torch.randint(0, 256, (4, 40), generator=g)]
        with torch.no_grad():
            e = head.midlayer.input_layernorm(head.embed_tokens(ids))
            y = head.fc_input(aux[:, :-1]) @ w_true.T + e[:, 1:] @ b_true.T
        final = torch.cat([torch.zeros(4, 1, H), y], 1)
        shard = {"aux": aux.bfloat16(), "final": final, "lens": torch.full((4,), 40), "ids": ids}
        save_file(shard, str(tmp_path / f"shard-{i:05d}.safetensors"))
    fit = linear_warm_start(head, tmp_path, 3, seed=0, ridge=1e-9)
    assert fit["embed"] and fit["r2"] > 0.9999, fit
    torch.testing.assert_close(head.fc.weight, w_true, atol=3e-3, rtol=0)
    toks = kept[torch.randperm(256, generator=g)[:6]].view(1, 6)  # distinct tokens
    aux = torch.randn(1, 6, 2 * H, generator=g)
    with torch.no_grad():
        hid = head.fuse(aux)
        out, _, _ = head.block(toks, hid, torch.arange(6))
        want = hid + head.midlayer.input_layernorm(head.embed_tokens(toks)) @ b_true.T
    err = (out - want).norm() / (want - hid).norm()
    assert err < 0.1, float(err)  # the softmax is sharp, not one-hot (measured 0.026)


def test_head_reading_the_last_residual_stream_trains(tmp_path, target4):
    """Aux id L (after the last layer) is also the warm start's target: captured once, used for both."""
    out = tmp_path / "h"
    meta = eagle3_train(
        Eagle3TrainConfig(
            target=str(target4), output=out, layer_ids=(1, 4), draft_vocab=256, max_steps=2, time_budget_s=None,
            keep_work=True, **SMALL,
        )
    )  # fmt: skip
    assert meta.layer_ids == [1, 4] and meta.steps == 2 and meta.warm_start["tokens"] > 0
    shard = load_file(str(tmp_path / ".h.draft-work" / "shard-00000.safetensors"))
    H = shard["final"].shape[-1]
    assert shard["aux"].shape[-1] == 2 * H  # not three chunks
    last = shard["aux"][..., H:].float()
    normed = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(normed, shard["final"].float(), atol=3e-2, rtol=3e-2)


@pytest.mark.slow  # one SGLang subprocess (~15 s)
def test_sglang_loads_the_head(trained):
    """SGLang 0.5.23's own LlamaForCausalLMEagle3, built on CPU, loads the exported head: every parameter
    but the embedding (shared with the target, as in vLLM) comes from the file, every tensor of the file
    lands (element counts equal), the fused qkv_proj is the file's q/k/v, and SGLang's hot_token_id (from
    d2t) is the kept vocabulary t2d marks."""
    from fp8ptq.engine.sglang_engine import run_checks

    out, _ = trained
    r = run_checks({"eagle3": {"path": str(out)}})["eagle3"]
    assert r["unloaded"] == ["model.embed_tokens.weight"], r["unloaded"]
    assert r["loaded_numel"] == r["file_numel"] and r["qkv_equal"], r
    t = load_file(str(out / "model.safetensors"))
    assert r["hot_token_id"] == t["t2d"].nonzero().flatten().tolist()
