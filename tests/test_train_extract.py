"""specgen-train feature extraction: packing, soft labels against an unbatched forward, the shard cache's resume."""

from __future__ import annotations

import io

import pytest
import torch

from specgen.models.tiny import build_tiny_model
from specgen.train.data import Corpus, lm_logits
from specgen.train.extract import exact_argmax, extract_features, pack_rows, packed_inputs, row_batches
from specgen.train.shards import Progress, extract_shards, plan_shards

VOCAB = 64


def _sequences(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


# ---- packing --------------------------------------------------------------------------------------------------

def test_pack_rows_places_every_sequence_once_and_whole():
    lengths = [int(n) for n in torch.randint(1, 30, (40,), generator=torch.Generator().manual_seed(1))] + [45]
    rows = pack_rows(lengths, 32)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    for row in rows:
        assert sum(lengths[i] for i in row) <= max(32, *(lengths[i] for i in row))
    assert [45] in [[lengths[i] for i in row] for row in rows]  # longer than a row: a row of its own
    # first-fit decreasing: no two rows could be merged
    fills = sorted(sum(lengths[i] for i in row) for row in rows)
    assert fills[0] + fills[1] > 32


def test_packed_inputs_have_no_padding_and_respect_boundaries():
    lengths = [5, 7, 6, 6]  # first-fit decreasing tiles two rows of 12 exactly
    seqs = _sequences(lengths)
    rows = pack_rows(lengths, 12)
    assert len(rows) == 2
    ids, positions, allowed, segments = packed_inputs(rows, seqs)
    assert ids.shape == (2, 12) and bool((segments >= 0).all())  # no padding at all
    for b, row in enumerate(rows):
        at = 0
        for i in row:
            n = lengths[i]
            assert ids[b, at: at + n].tolist() == seqs[i]
            assert positions[b, at: at + n].tolist() == list(range(n))  # positions restart per sequence
            at += n
    same = segments.unsqueeze(2) == segments.unsqueeze(1)
    assert not bool((allowed & ~same).any())  # nothing attends across a sequence boundary
    assert bool(allowed[0].diagonal().all()) and not bool(allowed[:, 0, 1:].any())  # causal
    assert [len(b) for b in row_batches(rows, lengths, 24)] == [2]
    assert [len(b) for b in row_batches(rows, lengths, 23)] == [1, 1]


# ---- soft labels ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("store_dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_packed_soft_labels_equal_an_unbatched_forward(store_dtype, atol):
    model = build_tiny_model(seed=2, vocab_size=VOCAB, init_scale=2.0).eval()
    lengths = [7, 19, 4, 11, 23, 2, 16]
    seqs = _sequences(lengths, seed=3)
    feats = extract_features(model, seqs, [1, 2], VOCAB, store_dtype=store_dtype, width=24, batch_tokens=48)
    assert len(pack_rows(lengths, 24)) < len(lengths)  # several sequences share a row
    draft = torch.tensor([0, 3, 5, 17, 40, 63])  # a draft vocabulary: the soft labels' slice
    weight = model.get_output_embeddings().weight.detach()
    for i, seq in enumerate(seqs):
        a, b = int(feats.offsets[i]), int(feats.offsets[i + 1])
        with torch.no_grad():
            out = model(torch.tensor([seq]), output_hidden_states=True)
        probs = torch.softmax(out.logits[0].float(), -1)  # [n, V], the target's own distribution
        p = torch.exp(lm_logits(feats.hidden[a:b], weight[draft]) - feats.lse[a:b, None])  # [n, Vd] as training
        assert torch.allclose(p, probs[:, draft], atol=atol), (i, float((p - probs[:, draft]).abs().max()))
        assert torch.equal(feats.argmax[a:b], out.logits[0].argmax(-1))
        assert torch.equal(feats.tokens[a:b], torch.tensor(seq))
        layers = torch.cat([out.hidden_states[1][0], out.hidden_states[2][0]], -1)
        assert torch.allclose(feats.feature[a:b].float(), layers, atol=atol * 10, rtol=1e-2)


def test_exact_argmax_recovers_ties_the_rounding_hides():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(25, 8, generator=gen)
    weight = torch.cat([weight, weight + 3e-3 * torch.randn(25, 8, generator=gen)])  # near-equal pairs of logits
    hidden = torch.randn(400, 8, generator=gen) * 4
    stored = hidden.to(torch.bfloat16)
    logits = lm_logits(stored, weight)
    truth = torch.nn.functional.linear(hidden, weight).argmax(-1)
    assert bool((logits.argmax(-1) != truth).any())  # the rounding does swap some of them
    best = exact_argmax(hidden, logits, stored, weight, None, weight.norm(dim=-1).max())
    assert torch.equal(best, truth)


# ---- shard cache ----------------------------------------------------------------------------------------------

def _tensors_equal(a: list[dict], b: list[dict]) -> bool:
    """Two lists of shards hold the same tensors, bit for bit."""
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b, strict=True))


def test_plan_shards_covers_the_corpus_in_order():
    assert plan_shards([5, 5, 5, 5, 3], 10) == [(0, 2), (2, 4), (4, 5)]
    assert plan_shards([12, 1], 10) == [(0, 1), (1, 2)]
    assert plan_shards([], 10) == []


def test_resume_after_a_stop_and_a_torn_shard_equals_one_run(tmp_path):
    model = build_tiny_model(seed=0, vocab_size=VOCAB).eval()
    corpus = Corpus(_sequences([9, 14, 6, 11, 8, 13, 7, 10, 12, 5], seed=4), "test")
    args = dict(store_dtype=torch.bfloat16, shard_tokens=20, progress=False)
    whole, info = extract_shards(model, corpus, [1], VOCAB, tmp_path / "whole", **args)
    assert info["shards"] == 5 and info["new"] == 5
    split = tmp_path / "split"
    parts, stopped = extract_shards(model, corpus, [1], VOCAB, split, max_new_shards=2, **args)
    assert parts is None and not stopped["complete"] and len(list(split.glob("shard-*.safetensors"))) == 2
    resumed, info = extract_shards(model, corpus, [1], VOCAB, split, **args)
    assert (info["reused"], info["new"]) == (2, 3) and _tensors_equal(resumed, whole)
    torn = split / "shard-00001.safetensors"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])  # a file cut short
    flipped = split / "shard-00003.safetensors"
    data = bytearray(flipped.read_bytes())
    data[-3] ^= 0xFF  # one byte of tensor data changed: still loads, checksum differs
    flipped.write_bytes(bytes(data))
    again, info = extract_shards(model, corpus, [1], VOCAB, split, **args)
    assert (info["reused"], info["new"]) == (3, 2) and _tensors_equal(again, whole)
    _, info = extract_shards(model, corpus, [1], VOCAB, split, **args)
    assert info["new"] == 0


@pytest.mark.parametrize("key", ["shard_tokens", "extract_tokens"])
def test_shard_and_batch_sizes_must_be_positive(tmp_path, key):
    from specgen.errors import ConfigError
    from specgen.train.cli import compose_train, run_train

    cfg = compose_train(["target=tiny", "train.kind=medusa", f"train.{key}=0", "train.progress=false",
                         f"train.out={tmp_path / 'h.safetensors'}"])
    with pytest.raises(ConfigError, match=f"train.{key} must be at least 1, got 0"):
        run_train(cfg, out=io.StringIO())


def test_progress_line_reports_tokens_rate_and_eta():
    stream = io.StringIO()
    bar = Progress(1000, 200, enabled=True, every=0.0, stream=stream)
    bar.update(300)
    line = stream.getvalue()
    assert "500/1,000 tokens" in line and "tokens/s" in line and "ETA" in line
    bar.update(0, force=True)
    assert stream.getvalue() == line  # nothing new: no repeated line
