"""Bad inputs refused with one clear error (issue 11, "Robustness beyond the list"):
verify_chain's input checks, damaged or NaN head files, and what the MTP drafter
may swallow."""

from __future__ import annotations

import pytest
import torch

import specgen
from conftest import TINY
from specgen.errors import ModelLoadError, NumericalError
from specgen.heads import HeadConfig, build_head, save_head, target_fingerprint
from specgen.engine.round import speculative_round
from specgen.sampling import NoAllowedToken, verify_chain


def probs(*rows):
    return torch.tensor(rows, dtype=torch.float64)


GOOD_P = probs([0.5, 0.25, 0.25], [0.2, 0.3, 0.5])  # [2, 3]
GOOD_Q = probs([0.4, 0.4, 0.2])  # [1, 3]


def _gen():
    return torch.Generator().manual_seed(0)


def test_verify_chain_accepts_good_input():
    verdict = verify_chain(GOOD_P, GOOD_Q, [1], _gen())
    assert verdict.num_accepted in (0, 1) and 0 <= verdict.next_token < 3


@pytest.mark.parametrize("tokens", [[-1], [3], [True], [1.0]])
def test_verify_chain_refuses_bad_token_ids(tokens):
    with pytest.raises(ValueError, match="is not a token id"):
        verify_chain(GOOD_P, GOOD_Q, tokens, _gen())


@pytest.mark.parametrize("target,draft,error,match", [
    (probs([float("nan"), 0.5, 0.5], [0.2, 0.3, 0.5]), GOOD_Q, NumericalError, "target_probs contains NaN"),
    (probs([1.2, -0.2, 0.0], [0.2, 0.3, 0.5]), GOOD_Q, NumericalError, "target_probs has negative"),
    (probs([0.5, 0.5, 0.5], [0.2, 0.3, 0.5]), GOOD_Q, NumericalError, "target_probs sums to"),
    (probs([0.0, 0.0, 0.0], [0.2, 0.3, 0.5]), GOOD_Q, NoAllowedToken, "every token is forbidden"),
    (GOOD_P, probs([0.4, float("nan"), 0.2]), NumericalError, "draft_probs contains NaN"),
    (GOOD_P, probs([0.9, -0.1, 0.2]), NumericalError, "draft_probs has negative"),
    (GOOD_P, probs([0.4, 0.4, 0.4]), NumericalError, "draft_probs sums to"),
    (GOOD_P, None, None, None),
])
def test_verify_chain_checks_its_rows(target, draft, error, match):
    if error is None:
        verify_chain(target, draft, [2], _gen())
        return
    with pytest.raises(error, match=match):
        verify_chain(target, draft, [1], _gen())


def test_verify_chain_checks_shapes():
    with pytest.raises(ValueError, match="need 2 target rows"):
        verify_chain(GOOD_P[:1], GOOD_Q, [1], _gen())
    with pytest.raises(ValueError, match="draft_probs shape"):
        verify_chain(GOOD_P, probs([0.5, 0.5]), [1], _gen())


# ---- head files ------------------------------------------------------------------------------------------------

def _tiny_model():
    return specgen.pipeline(*TINY, "drafter=none", progress=False).target.model


def _save(path, kind="mtp", poison=None):
    model = _tiny_model()
    d = model.config.hidden_size
    head = build_head(HeadConfig(kind=kind, hidden_size=d, draft_vocab_size=10, intermediate_size=2 * d),
                      torch.arange(10))
    if poison is not None:
        with torch.no_grad():
            poison(head)
    return save_head(path, head, target_fingerprint(model), dtype=torch.float32)


def _pipe(kind, path):
    return specgen.pipeline(*TINY, f"drafter={kind}", f"drafter.head_file={path}", "drafter.num_tokens=3",
                            progress=False)


def _overwrite_data(path, fill):
    """Keep the safetensors header, replace every data byte with ``fill(n)``."""
    raw = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(raw[:8], "little")
    raw[header:] = fill(len(raw) - header)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("fill", [
    lambda n: b"\xff" * n,  # floats NaN, ids -1
    lambda n: bytes(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(1),
                                  dtype=torch.uint8).tolist()),
])
def test_head_with_garbage_data_is_refused_at_load(tmp_path, fill):
    path = _save(tmp_path / "mtp.safetensors")
    _overwrite_data(path, fill)
    with pytest.raises(ModelLoadError, match="mtp.safetensors: .*(vocab_ids|NaN)"):
        _pipe("mtp", path)


def test_head_full_of_nan_is_refused_at_load(tmp_path):
    path = _save(tmp_path / "eagle.safetensors", "eagle",
                 poison=lambda head: head.fuse.weight.fill_(float("nan")))
    with pytest.raises(ModelLoadError, match=r"weights fuse.weight hold NaN or Inf"):
        _pipe("eagle", path)


def test_truncated_head_is_a_load_error(tmp_path):
    path = _save(tmp_path / "medusa.safetensors", "medusa")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="medusa.safetensors"):
        _pipe("medusa", path)


def test_missing_head_names_the_key(tmp_path):
    with pytest.raises(ModelLoadError, match=r"drafter\.head_file="):
        _pipe("mtp", tmp_path / "absent.safetensors")


# ---- MTP swallows only "no allowed token" ---------------------------------------------------------------------

def _mtp_session(tmp_path):
    path = _save(tmp_path / "mtp.safetensors", "mtp", poison=lambda h: [p.normal_(0, 0.3) for p in h.parameters()])
    pipe = specgen.pipeline(*TINY, "drafter=mtp", f"drafter.head_file={path}", "drafter.num_tokens=3",
                            "sampling.temperature=1.0", progress=False)
    request, ctx = pipe.open_request([1, 2, 3], max_new_tokens=30, seed=0)
    speculative_round(request, ctx, 3)  # hands the drafter its first feature
    return request


@pytest.mark.parametrize("total,swallowed", [(0.0, True), (float("nan"), False)])
def test_mtp_catches_only_no_allowed_token(tmp_path, monkeypatch, total, swallowed):
    """Device-resident draws (drafters/chain_draw.py): a step whose row allows nothing
    (total mass 0) ends the chain before it; a NaN row raises."""
    import specgen.drafters.chain_draw as chain_draw

    request = _mtp_session(tmp_path)
    assert len(request.draft.propose(3)) == 3
    calls = []
    real = chain_draw.draw_on_device

    def failing_second(q_row, u):
        calls.append(1)
        token, mass = real(q_row, u)
        return (token, torch.full_like(mass, total)) if len(calls) == 2 else (token, mass)

    monkeypatch.setattr(chain_draw, "draw_on_device", failing_second)
    if swallowed:
        assert len(request.draft.propose(3).tokens) == 1  # the chain stops where nothing is allowed
    else:
        with pytest.raises(NumericalError, match="NaN"):
            request.draft.propose(3)


@pytest.mark.parametrize("raised,swallowed", [(NoAllowedToken("nothing allowed"), True),
                                              (NumericalError("NaN logits"), False)])
def test_host_draws_catch_only_no_allowed_token(tmp_path, monkeypatch, raised, swallowed):
    """Host draws (a processor that reads token ids: bad_words) stop the chain on
    NoAllowedToken only."""
    import specgen.drafters.chain_draw as chain_draw

    path = _save(tmp_path / "mtp.safetensors", "mtp", poison=lambda h: [p.normal_(0, 0.3) for p in h.parameters()])
    pipe = specgen.pipeline(*TINY, "drafter=mtp", f"drafter.head_file={path}", "drafter.num_tokens=3",
                            "sampling.temperature=1.0", "sampling.bad_words=[[9,9]]", progress=False)
    request, ctx = pipe.open_request([1, 2, 3], max_new_tokens=30, seed=0)
    speculative_round(request, ctx, 3)
    calls = []

    def failing_second(q_row, generator, u=None):
        calls.append(1)
        if len(calls) == 2:
            raise raised
        return 1

    monkeypatch.setattr(chain_draw, "sample_token", failing_second)
    if swallowed:
        assert request.draft.propose(3).tokens == [1]
    else:
        with pytest.raises(NumericalError, match="NaN"):
            request.draft.propose(3)


SHIPPED_EAGLE = "specgen/heads/trained/smollm2-135m/eagle.safetensors"


@pytest.mark.parametrize("change, match", [
    ({"intermediate_size": 1_000_000}, r"tensor block\.down\.weight is \[576, 1536\] but its specgen\.config metadata "
                                       r"makes it \[576, 1000000\]"),
    ({"hidden_size": 10**12}, r"forged\.safetensors: its specgen\.config metadata .*; the file is damaged"),
    ({"intermediate_size": -5}, r"its specgen\.config metadata does not describe a head"),
])
def test_forged_head_metadata_is_refused_before_a_head_is_allocated(tmp_path, monkeypatch, change, match):
    """A copy of the shipped EAGLE head whose metadata sizes differ from its tensors: one line, and no
    head of the metadata's sizes is ever built (it would take gigabytes)."""
    import json
    import pathlib

    from safetensors import safe_open
    from safetensors.torch import save_file

    from specgen.heads import store

    with safe_open(str(pathlib.Path(specgen.__file__).parent.parent / SHIPPED_EAGLE), framework="pt") as f:
        tensors, meta = {n: f.get_tensor(n) for n in f.keys()}, dict(f.metadata())
    built = []
    monkeypatch.setattr(store, "build_head", lambda *args: built.append(args))
    store.check_shapes("shipped", HeadConfig.from_json(meta["specgen.config"]),
                       {n: t.shape for n, t in tensors.items()}, "x")  # the negative control: the shipped head fits
    forged = tmp_path / "forged.safetensors"
    save_file(tensors, str(forged), metadata=meta | {"specgen.config": json.dumps(
        json.loads(meta["specgen.config"]) | change)})
    with pytest.raises(ModelLoadError, match=match) as caught:
        store.load_head(forged, None, check_fingerprint=False)
    assert "\n" not in str(caught.value) and built == []
