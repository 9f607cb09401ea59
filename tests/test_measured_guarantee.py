"""exact/greedy come from a measurement at load (Target.verify_gap), for the torch backend too:
the spy sees it, a forced gap makes the run approximate naming it, a zero gap keeps the claim."""

from __future__ import annotations

import re

import pytest
import torch

from specgen.engine.assemble import verify_shapes
from specgen.models.causal_lm import CausalLM
from specgen.models.invariance import probe_tree, worst
from specgen.sampling import tree_depths

from conftest import tiny_pipeline


@pytest.fixture
def measured(monkeypatch):
    """Every CausalLM.verify_gap call's (widths, parents, result)."""
    calls = []
    real = CausalLM.verify_gap

    def spy(self, widths, parents=None, **kwargs):
        result = real(self, widths, parents, **kwargs)
        calls.append((list(widths), parents, result))
        return result

    monkeypatch.setattr(CausalLM, "verify_gap", spy)
    return calls


def _shift_multi_token_logits(monkeypatch, shift: float) -> None:
    """A target whose logits of a feed of several tokens are ``shift`` away from single-token ones."""
    real = CausalLM.forward

    def shifted(self, cache, new_tokens, keep, check=True):
        out = real(self, cache, new_tokens, keep, check)  # [keep, vocab]
        return out + shift if len(new_tokens) > 1 else out

    monkeypatch.setattr(CausalLM, "forward", shifted)


def test_the_torch_guarantee_is_measured_over_every_verify_width(measured):
    pipe = tiny_pipeline()
    assert len(measured) == 1, "the build must measure the torch target's verify pass once"
    widths, parents, (gap, _) = measured[0]
    assert widths == list(range(2, pipe.drafter.max_tokens + 2)) and parents is None
    assert gap == 0.0 and str(pipe.guarantee) == "greedy"  # invariant_verify=true (conftest): measured equal
    assert str(tiny_pipeline("sampling=creative").guarantee) == "exact" and len(measured) == 2


def test_off_runs_are_not_measured(measured):
    assert str(tiny_pipeline("speculative=false").guarantee) == "off: speculative=false"
    assert tiny_pipeline(drafter="none").guarantee.kind == "off"
    assert measured == []


def test_a_forced_gap_makes_the_run_approximate_naming_it(monkeypatch, measured):
    _shift_multi_token_logits(monkeypatch, 1e-6)
    pipe = tiny_pipeline()
    gap, width = measured[0][2]
    assert 5e-7 < gap < 2e-6  # the probe measured the shift through the real forwards
    assert pipe.guarantee.kind == "approximate"
    reason = pipe.guarantee.reason
    assert reason.startswith(f"tiny on torch (float32) computes {width}-token verify logits up to {gap:.2g} away")
    assert float(re.search(r"up to (\S+) away", reason).group(1)) == pytest.approx(gap, rel=0.05)


def test_the_fast_torch_path_declares_what_it_measures(measured):
    """Without invariant_verify the tiny float32 model runs the fast verify pass: whatever this
    CPU's kernels give, the label follows the measurement (approximate naming the gap where it is
    not zero), never the config alone."""
    pipe = tiny_pipeline("invariant_verify=false")
    gap, width = measured[0][2]
    if gap == 0.0:
        assert str(pipe.guarantee) == "greedy"
    else:
        assert pipe.guarantee.kind == "approximate" and f"{width}-token verify logits up to {gap:.2g}" \
            in pipe.guarantee.reason


def test_tree_forwards_are_measured_node_by_node(monkeypatch):
    lm = tiny_pipeline(drafter="none").target
    parents = probe_tree(2, 3)  # two branches three deep: 6 nodes
    assert lm.verify_gap([2, 3, 4], parents=parents) == (0.0, 2)
    real = CausalLM.forward_tree

    def shifted(self, *args, **kwargs):  # every tree row but the root's 2e-6 away
        out = real(self, *args, **kwargs)
        out.hidden = out.hidden.clone()
        out.hidden[1:] += 2e-6
        return out

    monkeypatch.setattr(CausalLM, "forward_tree", shifted)
    gap, fed = lm.verify_gap([2, 3, 4], parents=parents)
    assert gap > 0.0 and fed in (2, 3, 4, 7)  # 1..3 nodes and the whole tree, after the root token


def test_a_tree_drafter_is_measured_on_tree_forwards(measured, tiny_eagle_head):
    pipe = tiny_pipeline("target.source.vocab_size=8", f"drafter.head_file={tiny_eagle_head}", drafter="eagle")
    widths, parents, (gap, _) = measured[0]
    assert (widths, parents) == verify_shapes(pipe.drafter) and parents is not None
    assert len(parents) == pipe.drafter.max_nodes == min(pipe.drafter.nodes, 64)
    assert max(tree_depths(parents)) == pipe.drafter.max_tokens  # every depth a round may verify
    assert gap == 0.0 and str(pipe.guarantee) == "greedy"


def test_worst_picks_the_largest_gap_and_the_narrowest_width_on_a_tie():
    assert worst({2: 0.0, 3: 1e-6, 9: 1e-6, 5: 5e-7}) == (1e-6, 3)
    assert worst({}) == (0.0, 0)


def test_probe_tree_prefixes_are_trees():
    parents = probe_tree(3, 2)
    assert parents == [-1, -1, -1, 0, 1, 2]
    assert all(p < i for i, p in enumerate(parents))


def test_invariant_verify_is_checked():
    from specgen.errors import ConfigError

    with pytest.raises(ConfigError, match="invariant_verify"):
        tiny_pipeline("invariant_verify=maybe")


def test_invariant_verify_makes_rows_independent_of_the_feed():
    """The invariant configuration computes each fed position as a single-token step does, also
    for a batched feed of several rows (linear row by row, attention query by query)."""
    lm = tiny_pipeline(drafter="none").target
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    cache = lm.new_cache()
    together = lm.forward(cache, tokens, keep=len(tokens))  # [8, vocab]
    cache = lm.new_cache()
    alone = torch.cat([lm.forward(cache, [t], keep=1) for t in tokens])  # [8, vocab]
    assert torch.equal(together, alone)
