"""The DSpark block drafter (specgen/heads/dspark.py, specgen/drafters/dspark.py) on the tiny target.

Heads are random (built in code, written in the real head format) over a reduced draft
vocabulary, so q is zero on some tokens and the Markov head's out-of-vocabulary row is
used. Exactness is statistical against the enumerated target distribution (chi-square,
exact.py), with negative controls that must fail the same check: verifying against the
rows *before* the Markov correction (a wrong q), and a stopper that peeks at the target's
p of the drafted token. The legal stopper, fed the head's confidence c_k, passes it.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from safetensors.torch import load_file

import specgen
from conftest import TINY
from exact import exact_distribution, goodness_of_fit, peeking_draw, sample_counts
from specgen.drafters.chain_draw import ChainDraws
from specgen.drafters.dspark import DsparkSession
from specgen.errors import ConfigError, ModelLoadError
from specgen.heads import DsparkHead, HeadConfig, build_head, load_head, save_head, target_fingerprint
from specgen.models.tiny import build_tiny_model
from specgen.planning import ChainStopper, CostTable
from specgen.processors import DeviceHistory, History
from specgen.train import losses

VOCAB8 = ("target.source.vocab_size=8", "target.source.init_scale=2")
PROMPT = [1, 2, 3]
DRAFT_VOCAB = [0, 1, 2, 4, 5, 7]  # q is zero on 3 and 6; a committed 3 or 6 reads W1's extra row
LENGTH = 4
NUM_SAMPLES = 1200
MIN_P_VALUE = 1e-3
T1 = ("sampling.temperature=1.0", "drafter.num_tokens=3")
STACK = ("sampling.temperature=0.8", "sampling.top_k=5", "sampling.repetition_penalty=1.5",
         "sampling.presence_penalty=0.8")
#: A drafter paid per token with a nearly flat verify: the online stopper, fed c_k, decides each chain's length.
COSTLY_DRAFTS = CostTable(chain=tuple(1.0 + 0.02 * n for n in range(8)), tree=(), draft_per_token=0.12, step_s=1e-3)


def _head(d: int, seed: int = 0, block_size: int = 4) -> DsparkHead:
    cfg = HeadConfig(kind="dspark", hidden_size=d, draft_vocab_size=len(DRAFT_VOCAB), intermediate_size=2 * d,
                     block_size=block_size, markov_rank=8)
    generator = torch.Generator().manual_seed(seed)
    head = build_head(cfg, torch.tensor(DRAFT_VOCAB))
    with torch.no_grad():
        for param in head.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    return head


@pytest.fixture(scope="module")
def head_file(tmp_path_factory) -> str:
    model = specgen.pipeline(*TINY, *VOCAB8, "drafter=none", progress=False).target.model
    head = _head(model.config.hidden_size)
    path = tmp_path_factory.mktemp("dspark") / "dspark.safetensors"
    return str(save_head(path, head, target_fingerprint(model), command="test", dtype=torch.float32))


def _pipe(head_file: str, *overrides: str):
    return specgen.pipeline(*TINY, *VOCAB8, "drafter=dspark", f"drafter.head_file={head_file}", *overrides,
                            progress=False)


def _p_value(pipe) -> float:
    expected = exact_distribution(pipe, PROMPT, LENGTH)
    counts = sample_counts(pipe, PROMPT, LENGTH, NUM_SAMPLES)
    p_value, tv = goodness_of_fit(counts, expected)
    print(f"chi-square p={p_value:.2e}, TV={tv:.3f}")
    return p_value


def _drafted(pipe, seeds: int = 20) -> int:
    return sum(pipe.generate(prompt_ids=PROMPT, max_new_tokens=8, seed=s).stats.drafted for s in range(seeds))


# ---- exactness ----------------------------------------------------------------------------------------------

def test_block_drafter_is_exact_at_t1(head_file):
    pipe = _pipe(head_file, *T1)
    assert str(pipe.guarantee) == "exact" and _drafted(pipe) > 20
    assert _p_value(pipe) > MIN_P_VALUE


def _draft_history(draws: ChainDraws):
    """The history the step just drawn was processed with (the tokens drawn before it)."""
    earlier = draws.tokens[:-1]
    if draws.on_device:
        drafted = torch.cat(earlier) if earlier else torch.zeros(0, dtype=torch.long)
        return DeviceHistory(draws.committed, drafted)
    return History(draws.committed, earlier, num_positions=1, start=len(earlier))


def test_verifying_against_the_rows_before_the_markov_correction_is_caught(head_file, monkeypatch):
    """Tokens drawn from the corrected logits but verified against the processed base rows U_k: not exact."""
    pipe = _pipe(head_file, *T1)
    vocab_ids = pipe.drafter.head.vocab_ids
    markov, draw, bases = DsparkHead.markov, ChainDraws.draw, []

    def recording(self, base, previous):
        bases.append(base)
        return markov(self, base, previous)

    def wrong_q(self, raw, greedy_peak_logits, confidence=None):
        token = draw(self, raw, greedy_peak_logits, confidence)
        if token is not None:
            full = torch.full_like(raw, float("-inf"))  # [1, vocab]
            full[:, vocab_ids] = bases[-1].float()
            self.rows[-1] = self.stack.probs(full, _draft_history(self))[0]
        return token

    monkeypatch.setattr(DsparkHead, "markov", recording)
    monkeypatch.setattr(ChainDraws, "draw", wrong_q)
    assert _p_value(pipe) < MIN_P_VALUE


@pytest.fixture
def costly(head_file, monkeypatch):
    """A processor stack, γ = auto with a drafter paid per token, and every stopper question recorded."""
    monkeypatch.setattr("specgen.planning.cost_cache.cost_table", lambda subject, **kwargs: COSTLY_DRAFTS)
    pipe = _pipe(head_file, *STACK)
    asked: list[float] = []
    decisions: list[tuple[str, bool]] = []
    keep, more = ChainStopper.keep, ChainStopper.more

    def recording_keep(self, confidence):
        asked.append(confidence)
        decisions.append(("keep", keep(self, confidence)))
        return decisions[-1][1]

    def recording_more(self):
        decisions.append(("more", more(self)))
        return decisions[-1][1]

    monkeypatch.setattr(ChainStopper, "keep", recording_keep)
    monkeypatch.setattr(ChainStopper, "more", recording_more)
    return pipe, asked, decisions


def test_the_planner_stops_on_the_heads_confidence_and_stays_exact(costly, monkeypatch):
    pipe, asked, decisions = costly
    assert pipe.drafter.num_tokens == "auto" and pipe.drafter.max_tokens == 4  # the head's block size
    head_confidences: list[float] = []
    confidence = DsparkHead.confidence

    def recording(self, state, previous):
        value = confidence(self, state, previous)
        head_confidences.extend(value.tolist())
        return value

    monkeypatch.setattr(DsparkHead, "confidence", recording)
    assert _drafted(pipe, seeds=30) > 20
    assert ("keep", True) in decisions and ("more", True) in decisions  # chains of several tokens ...
    assert ("keep", False) in decisions or ("more", False) in decisions  # ... which the stopper also cut
    assert asked == pytest.approx(head_confidences[: len(asked)], abs=1e-6)  # c_k, step by step
    assert len(asked) == len(head_confidences)
    monkeypatch.setattr(DsparkHead, "confidence", confidence)
    assert _p_value(pipe) > MIN_P_VALUE


def test_a_stopper_that_peeks_at_the_target_is_caught(costly, monkeypatch):
    """The same online path, but a drawn token is dropped (and the chain stopped) when the target's p of it
    is below q: the drafts the verifier might reject never reach it."""
    pipe, _, _ = costly
    monkeypatch.setattr(ChainDraws, "draw", peeking_draw(pipe, 8))
    assert _p_value(pipe) < MIN_P_VALUE


def test_greedy_equals_plain(head_file):
    pipe = _pipe(head_file, "sampling.temperature=0", "sampling.repetition_penalty=1.3")
    assert str(pipe.guarantee) == "greedy"
    drafted = 0
    for prompt in ([1, 2, 3], [5, 4, 7, 1], [2]):
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=40, seed=0)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=40, seed=0, speculative=False)
        assert spec.token_ids == plain.token_ids
        drafted += spec.stats.drafted
    assert drafted > 0


# ---- the head ------------------------------------------------------------------------------------------------

def test_the_markov_head_conditions_on_the_previous_token():
    generator = torch.Generator().manual_seed(100)
    head = _head(16).eval()
    head.attach(torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator))
    feature = torch.randn(1, 16, generator=torch.Generator().manual_seed(1))
    states, base = head.block(feature, torch.tensor([2]))
    assert states.shape == (1, 4, 16) and base.shape == (1, 4, len(DRAFT_VOCAB))
    with torch.no_grad():
        by_previous = {x: head.markov(base[:, 1], torch.tensor([x])) for x in range(8)}
        # the correction is exactly W1[index(x)] @ W2; 3 and 6 (outside the draft vocabulary) share the extra row
        for x, logits in by_previous.items():
            row = DRAFT_VOCAB.index(x) if x in DRAFT_VOCAB else len(DRAFT_VOCAB)
            torch.testing.assert_close(logits - base[:, 1], head.markov_in.weight[row:row + 1] @ head.markov_out)
        assert not torch.allclose(by_previous[0], by_previous[1])
        assert not torch.allclose(by_previous[4], by_previous[3])
        torch.testing.assert_close(by_previous[3], by_previous[6])
        c = head.confidence(states[:, 1], torch.tensor([0])), head.confidence(states[:, 1], torch.tensor([1]))
        assert 0 < float(c[0]) < 1 and float(c[0]) != float(c[1])


def test_the_backbone_runs_once_a_round_and_each_step_reads_the_token_drawn_before_it(head_file, monkeypatch):
    pipe = _pipe(head_file, *T1)
    calls = {"block": 0, "previous": []}
    block, markov, propose = DsparkHead.block, DsparkHead.markov, DsparkSession.propose
    rounds = []

    def counting_block(self, *args, **kwargs):
        calls["block"] += 1
        return block(self, *args, **kwargs)

    def counting_markov(self, base, previous):
        calls["previous"].append(int(previous.reshape(-1)[0]))
        return markov(self, base, previous)

    def watched(self, budget, stopper=None):
        calls["block"], calls["previous"] = 0, []
        proposal = propose(self, budget, stopper)
        rounds.append((calls["block"], list(calls["previous"]), self.ctx.committed.tokens[-1], proposal.tokens))
        return proposal

    monkeypatch.setattr(DsparkHead, "block", counting_block)
    monkeypatch.setattr(DsparkHead, "markov", counting_markov)
    monkeypatch.setattr(DsparkSession, "propose", watched)
    for seed in range(4):
        pipe.generate(prompt_ids=PROMPT, max_new_tokens=12, seed=seed)
    drafted = [r for r in rounds if r[3]]
    assert drafted and max(len(r[3]) for r in drafted) == 3
    for blocks, previous, newest, tokens in drafted:
        assert blocks == 1  # one backbone pass for the whole chain
        assert previous[: len(tokens)] == [newest, *tokens[:-1]]  # step k reads x_{k-1}


def test_config_errors_are_one_line(head_file):
    with pytest.raises(ConfigError, match="exceeds the dspark head's block size 4"):
        _pipe(head_file, "drafter.num_tokens=5")
    with pytest.raises(ConfigError, match="drafter=dspark needs drafter.head_file"):
        specgen.pipeline(*TINY, "drafter=dspark", progress=False)
    with pytest.raises(ModelLoadError, match="holds a dspark head"):
        specgen.pipeline(*TINY, *VOCAB8, "drafter=mtp", f"drafter.head_file={head_file}", progress=False)


# ---- training -----------------------------------------------------------------------------------------------

def test_confidence_target_is_one_minus_total_variation():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.5]])  # row 2: 0.2 of p lies outside the slice
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    # TV over the full vocabulary (q is 0 outside): row 1: (0.25 + 0.05 + 0.05 + 0.25) / 2 = 0.3;
    # row 2: (0.6 + 0 + 0 + 0.4 + 0.2 outside) / 2 = 0.6
    target = losses.confidence_target(q.log().requires_grad_(), p)
    assert torch.allclose(target, torch.tensor([0.7, 0.4]), atol=1e-6) and not target.requires_grad
    logit = torch.tensor([0.0, 2.0])
    bce = -(target * torch.log(torch.sigmoid(logit)) + (1 - target) * torch.log(1 - torch.sigmoid(logit))).mean()
    assert math.isclose(float(losses.confidence_loss("bce", logit, target)), float(bce), rel_tol=1e-5)
    mse = ((torch.sigmoid(logit) - target) ** 2).mean()
    assert math.isclose(float(losses.confidence_loss("mse", logit, target)), float(mse), rel_tol=1e-5)
    with pytest.raises(ValueError, match="confidence loss"):
        losses.confidence_loss("l1", logit, target)


TRAIN = ["target=tiny", "train.kind=dspark", "train.head.intermediate_size=48", "train.head.draft_vocab_size=12",
         "train.head.block_size=3", "train.head.markov_rank=8", "train.num_conversations=24", "train.max_len=48",
         "train.eval_conversations=6", "train.batch_tokens=64", "train.lr=3e-3", "train.warmup_steps=2",
         "train.threads=1", "train.progress=false", "train.device=cpu"]


def test_training_lowers_the_loss_and_the_head_file_round_trips(tmp_path, monkeypatch):
    from specgen.train import loop
    from specgen.train.cli import compose_train, run_train

    monkeypatch.setenv("SPECGEN_CACHE", str(tmp_path / "cache"))
    seen = {}
    train_head = loop.train_head

    def spy(head, *args, **kwargs):
        result = train_head(head, *args, **kwargs)
        seen["losses"], seen["head"] = result.losses, head
        return result

    monkeypatch.setattr(loop, "train_head", spy)
    cfg = compose_train([*TRAIN, "train.steps=40", "train.loss=kl", f"train.out={tmp_path / 'd.safetensors'}"])
    run = run_train(cfg, command="test dspark", out=io.StringIO())
    values = seen["losses"]
    assert len(values) == 40 and sum(values[-8:]) / 8 < sum(values[:8]) / 8, values
    metrics = run.info["metrics"]
    assert len(metrics["accept"]) == 3 and len(metrics["confidence"]) == 3
    assert all(0.0 <= v <= 1.0 for v in metrics["accept"] + metrics["confidence"] + metrics["confidence_error"])
    head, meta = load_head(run.path, build_tiny_model(seed=0), kind="dspark")
    assert (head.cfg.block_size, head.cfg.markov_rank, meta["specgen.command"]) == (3, 8, "test dspark")
    stored = load_file(str(run.path))
    trained = seen["head"].state_dict()
    assert stored.keys() == trained.keys() == head.state_dict().keys()
    for name, value in head.state_dict().items():  # stored in bfloat16: the loaded head holds exactly that
        assert torch.equal(value, stored[name].to(value.dtype))
        assert torch.equal(value, trained[name].to(stored[name].dtype).to(value.dtype))
    with pytest.raises(ModelLoadError, match="different target"):
        load_head(run.path, build_tiny_model(seed=1), kind="dspark")


def test_a_float32_head_file_drafts_what_the_head_drafted(tmp_path):
    model = build_tiny_model(seed=0)
    head = _head(model.config.hidden_size, seed=3)
    path = save_head(tmp_path / "h.safetensors", head, target_fingerprint(model), dtype=torch.float32)
    loaded, _ = load_head(path, model, kind="dspark")
    assert loaded.cfg == head.cfg
    head.attach(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    features = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))  # [B, d]
    tokens = torch.tensor([[1, 3, 0, 7, 2], [4, 4, 6, 1, 0], [2, 5, 5, 3, 1]])  # [D, B]
    with torch.no_grad():
        for got, want in zip(loaded.teacher_forced(features, tokens), head.teacher_forced(features, tokens),
                             strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
