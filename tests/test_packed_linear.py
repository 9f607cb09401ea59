"""specgen.models.packed_linear: oneDNN-packed linear layers compute linear's product, where they apply, and follow their weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_pipeline

import specgen
from specgen.models import packed_linear
from specgen.models.batch_kv import BatchKV
from specgen.models.causal_lm import CausalLM
from specgen.models.packed_linear import PackedLinear
from specgen.models.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="this torch build has no oneDNN")


@pytest.fixture(autouse=True)
def _pack_small_weights(monkeypatch):
    """The layers here are small: they are packed as a released model's are (the size gate has its own test)."""
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)


def test_weights_below_the_size_gate_run_linear_and_those_at_it_are_packed(monkeypatch):
    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 64 * 300)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=generator)
    small, large = PackedLinear.of(torch.nn.Linear(64, 299)), PackedLinear.of(torch.nn.Linear(64, 300))
    with torch.inference_mode():
        assert torch.equal(small(x), F.linear(x, small.weight, small.bias))
        assert torch.allclose(large(x), F.linear(x, large.weight, large.bias), rtol=1e-5, atol=1e-4)
    assert small.packed.packed is None and large.packed.packed is not None


def _layer(rows: int, bias: bool) -> tuple[torch.nn.Linear, torch.Generator]:
    generator = torch.Generator().manual_seed(rows + 100 * bias)
    layer = torch.nn.Linear(64, 300, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(300, 64, generator=generator))
        if bias:
            layer.bias.copy_(torch.randn(300, generator=generator))
    return layer, generator


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 17])
def test_same_product_as_linear_on_the_packed_path(rows, bias):
    layer, generator = _layer(rows, bias)
    fast = PackedLinear.of(layer)
    x = torch.randn(1, rows, 64, generator=generator)  # [batch, rows, in], as a decoder layer sees it
    with torch.inference_mode():
        out = fast(x)
        expected = layer(x)
    assert fast.packed.packed is not None  # the packed path ran
    assert out.shape == expected.shape == (1, rows, 300)
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-4)


def _counted(lm: CausalLM) -> list[int]:
    """Rows each PackedLinear of ``lm`` multiplies, one entry a call."""
    rows = []
    for module in lm.model.modules():
        if isinstance(module, PackedLinear):
            forward = module.forward
            module.forward = lambda x, forward=forward: rows.append(x.numel() // x.shape[-1]) or forward(x)
    return rows


@pytest.mark.parametrize("enabled", [True, False])
def test_a_ragged_batched_forward_multiplies_real_tokens_only(enabled):
    """A ragged batched forward feeds its rows flat: every linear layer multiplies the real tokens
    only (no padding reaches it), each row's logits are its own; a uniform feed multiplies them all."""
    lm = CausalLM(build_tiny_model(seed=3, vocab_size=32, num_heads=4, num_kv_heads=2), vocab_size=32,
                  packed=enabled)
    rows = _counted(lm)
    kv = BatchKV(lm, 3)
    feeds = [[3, 4, 5, 6], [7], [8, 9]]
    with torch.inference_mode():
        out = kv.forward(feeds, [len(f) for f in feeds])
        assert rows and set(rows) == {7}, "only the 7 real tokens were multiplied, never 3 x 4"
        for feed, logits in zip(feeds, out, strict=True):
            alone = lm.forward(lm.new_cache(), feed, keep=len(feed))  # [n, vocab]
            assert torch.allclose(logits, alone, rtol=1e-5, atol=1e-5)
        rows.clear()
        kv.forward([[1, 2], [3, 4], [5, 6]], [2, 2, 2])
    assert set(rows) == {6}


def test_ragged_batched_steps_keep_greedy_rows(monkeypatch):
    """Ragged batched steps (rows drafting different lengths) fed flat give the tokens of single requests."""
    pipe = tiny_pipeline("drafter.num_tokens=3", drafter="ngram")
    prompts = [dict(prompt_ids=[1 + i, 2, 3, 1 + i, 2, 3][: 3 + i], max_new_tokens=12) for i in range(4)]
    original = CausalLM.forward_batch
    steps = []

    def recording(self, cache, ids, positions, allowed, lengths, picks):
        steps.append(list(lengths))
        return original(self, cache, ids, positions, allowed, lengths, picks)

    monkeypatch.setattr(CausalLM, "forward_batch", recording)
    batched = [g.token_ids for g in pipe.generate_batch(prompts, batch_size=4)]
    assert any(len(set(lengths)) > 1 for lengths in steps), "some step was ragged"
    assert batched == [pipe.generate(**p).token_ids for p in prompts]


def test_follows_its_weight_changed_in_place_or_replaced():
    layer, generator = _layer(2, False)
    fast = PackedLinear.of(layer)
    x = torch.randn(2, 64, generator=generator)
    with torch.inference_mode():
        before = fast(x)
    with torch.no_grad():
        fast.weight.mul_(2.0)
    with torch.inference_mode():
        assert torch.allclose(fast(x), 2.0 * before, rtol=1e-5, atol=1e-4)
    fast.weight = torch.nn.Parameter(torch.zeros(300, 64))
    with torch.inference_mode():
        assert torch.equal(fast(x), torch.zeros(2, 300))


def test_other_dtypes_autograd_and_disabled_layers_run_linear():
    layer, generator = _layer(3, True)
    x = torch.randn(3, 64, generator=generator)
    wide = PackedLinear.of(torch.nn.Linear(64, 50).to(torch.float64))
    with torch.inference_mode():
        assert torch.equal(wide(x.double()), F.linear(x.double(), wide.weight, wide.bias))
    assert wide.packed.packed is None
    half = PackedLinear.of(torch.nn.Linear(64, 50).to(torch.bfloat16))
    with torch.inference_mode():  # bfloat16 is packed where this CPU packs it, else it runs linear
        assert torch.allclose(half(x.bfloat16()).float(), F.linear(x.bfloat16(), half.weight, half.bias).float(),
                              rtol=2e-2, atol=5e-2)
    assert (half.packed.packed is not None) == packed_linear.packable(torch.bfloat16)
    fast = PackedLinear.of(layer)
    out = fast(x)  # grad enabled, weight requires grad: linear, so gradients flow
    out.sum().backward()
    assert fast.packed.packed is None and layer.weight.grad is not None
    fast.enabled = False
    with torch.inference_mode():
        assert torch.equal(fast(x), F.linear(x, layer.weight, layer.bias))
    assert fast.packed.packed is None


def test_install_replaces_every_linear_keeps_ties_and_switches_off():
    model = build_tiny_model(seed=0, vocab_size=40)
    model.lm_head.weight = model.get_input_embeddings().weight  # tied, as SmolLM2's are
    ids = torch.tensor([[1, 5, 7]])
    with torch.inference_mode():
        before = model(ids).logits  # [1, 3, vocab]
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert packed_linear.install(model) == linears > 0
    assert packed_linear.install(model) == 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    with torch.inference_mode():
        after = model(ids).logits
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-5)
    packed_linear.set_enabled(model, False)
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)


def test_packed_weights_false_keeps_linear_in_every_model():
    on = specgen.pipeline("target=tiny", "drafter=tiny", "threads=1", progress=False)
    off = specgen.pipeline("target=tiny", "drafter=tiny", "threads=1", "packed_weights=false", progress=False)
    for pipe, enabled in ((on, True), (off, False)):
        models = [pipe.target.model, pipe.drafter.lm.model]
        layers = [m for model in models for m in model.modules() if isinstance(m, PackedLinear)]
        assert layers and all(m.enabled is enabled for m in layers)
    first, second = on.generate("a b", max_new_tokens=8, seed=0), off.generate("a b", max_new_tokens=8, seed=0)
    assert first.token_ids == second.token_ids
    with pytest.raises(specgen.ConfigError, match="packed_weights"):
        specgen.pipeline("target=tiny", "packed_weights=maybe", progress=False)


@pytest.mark.parametrize("kind", ["eagle", "mtp", "medusa", "dspark"])
def test_a_packed_head_drafts_what_the_unpacked_head_drafts(kind):
    import copy

    from specgen.heads import HeadConfig, build_head

    generator = torch.Generator().manual_seed(1)
    cfg = HeadConfig(kind=kind, hidden_size=32, draft_vocab_size=30, intermediate_size=48)
    head = build_head(cfg, torch.arange(30)).eval().requires_grad_(False)
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    embed, lm = torch.randn(40, 32, generator=generator), torch.randn(40, 32, generator=generator)
    packed = copy.deepcopy(head)
    head.attach(embed, lm)
    packed.attach(embed, lm, packed=True)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, PackedLinear) for m in head.modules())
    feature, tokens = torch.randn(3, 32, generator=generator), torch.tensor([1, 4, 9])
    with torch.inference_mode():
        if kind == "medusa":
            expected, got = head(feature), packed(feature)
        elif kind == "dspark":  # tokens [D = 3, B = 3]
            steps = torch.stack([tokens, tokens.flip(0), tokens])
            expected, got = head.teacher_forced(feature, steps), packed.teacher_forced(feature, steps)
            expected, got = torch.cat([expected[0], expected[1].unsqueeze(-1)], -1), \
                torch.cat([got[0], got[1].unsqueeze(-1)], -1)
        else:
            expected, got = head.step(feature, tokens), packed.step(feature, tokens)
            expected, got = torch.cat(expected, -1), torch.cat(got, -1)
    assert packed.packed_lm_rows.packed is not None
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-4)


def test_a_batched_forward_feeds_the_rows_flat(monkeypatch):
    """BatchKV.forward hands the held rows' feeds to forward_batch flat, with each row's length and
    the flat indices of the logits kept; idle rows are not held."""
    lm = CausalLM(build_tiny_model(seed=0), vocab_size=16)
    seen = {}
    original = CausalLM.forward_batch

    def recording(self, cache, ids, positions, allowed, lengths, picks):
        seen.update(ids=ids.tolist(), positions=positions.tolist(), shape=tuple(allowed.shape), lengths=list(lengths),
                    picks=picks.tolist())
        return original(self, cache, ids, positions, allowed, lengths, picks)

    monkeypatch.setattr(CausalLM, "forward_batch", recording)
    kv = BatchKV(lm, 4)
    with torch.inference_mode():
        out = kv.forward([[5, 6], [], [7], [8, 9, 10]], [1, 0, 1, 2])
    assert seen == dict(ids=[5, 6, 7, 8, 9, 10], positions=[0, 1, 0, 0, 1, 2], shape=(3, 3, 3), lengths=[2, 1, 3],
                        picks=[1, 2, 4, 5])
    assert [None if o is None else o.shape[0] for o in out] == [1, None, 1, 2]
    assert kv.width == 3 and [len(row) for row in kv.rows] == [2, 0, 1, 3]
