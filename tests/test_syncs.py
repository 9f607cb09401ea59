"""Host<->device synchronisations per round, counted on the CPU (issue 14, "lean rounds").

On a GPU every value read back to Python (``.item()``, ``.tolist()``, ``float(t)``,
``int(t)``, ``bool(t)``, ``.nonzero()``, ``.cpu()``) stalls the stream. The CPU has
no stream to stall, so a counting hook on those tensor methods stands in for
``torch.cuda.set_sync_debug_mode``: it counts every read the round's code makes,
in specgen and in the libraries it calls, during one round driven through
``Pipeline.open_request`` + ``speculative_round``.
"""

from __future__ import annotations

import pytest
import torch

import specgen
from conftest import TINY
from specgen.bench.host_reads import counting_reads
from specgen.heads import HeadConfig, build_head, save_head, target_fingerprint
from specgen.engine.round import speculative_round

CHAIN_LIMIT, TREE_LIMIT = 3, 5
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4]  # repeats, so the n-gram drafter proposes
#: The fast path a device runs by default: invariant_verify's per-query attention reads each query's
#: visible keys back to the host (an opt-in exact configuration, not what these limits are for).
FAST = (*TINY, "invariant_verify=false")

#: These tests count a device's reads on the CPU, so argmax takes the device's path (conftest.device_path).
pytestmark = pytest.mark.usefixtures("device_path")


def test_the_hook_counts_reads():
    t = torch.tensor([1.0, 2.0])
    with counting_reads() as count:
        float(t[0]), t.tolist(), bool(t.any()), t.nonzero(), int(t[1]), t.sum().item()
        t + t  # not a read
    assert count[0] == 6


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    base = tmp_path_factory.mktemp("sync-heads")
    model = specgen.pipeline(*FAST, "drafter=none", progress=False).target.model
    d = model.config.hidden_size
    out = {}
    for kind in ("eagle", "medusa", "mtp"):
        torch.manual_seed(0)
        head = build_head(HeadConfig(kind=kind, hidden_size=d, draft_vocab_size=16, intermediate_size=2 * d,
                                     num_heads=4), torch.arange(16))
        with torch.no_grad():
            for param in head.parameters():
                param.normal_(0.0, 0.3)
        out[kind] = str(save_head(base / f"{kind}.safetensors", head, target_fingerprint(model), dtype=torch.float32))
    return out


def reads_per_round(kind: str, heads, temperature: float, gamma: int, rounds: int = 4,
                    overrides: tuple = (), read_once: bool = True) -> tuple[list[tuple[int, int]], int]:
    """([(host reads, accepted tokens)] of ``rounds`` rounds after two warm-up rounds, tokens drafted in them).

    read_once: rounds as off the CPU (Pipeline.read_once: one read per verification);
    False: the CPU's rounds, which do less arithmetic and read more."""
    head = (f"drafter.head_file={heads[kind]}",) if kind in heads else ()
    pipe = specgen.pipeline(*FAST, f"drafter={kind}", *head, f"drafter.num_tokens={gamma}",
                            f"sampling.temperature={temperature}", "sampling.min_new_tokens=150",  # no early EOS
                            *overrides, progress=False)
    pipe.read_once = read_once
    request, ctx = pipe.open_request(PROMPT, max_new_tokens=200, seed=0)
    for _ in range(2):
        speculative_round(request, ctx, gamma)
    drafted_before, counts = ctx.stats.drafted, []
    for _ in range(rounds):
        with counting_reads() as count:
            events = speculative_round(request, ctx, gamma)
        counts.append((count[0], sum(e.kind == "accepted" for e in events)))
    return counts, ctx.stats.drafted - drafted_before


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("gamma", [2, 6])
def test_chain_round_reads_are_few_and_independent_of_gamma(heads, temperature, gamma):
    counts, drafted = reads_per_round("ngram", heads, temperature, gamma)
    assert drafted > 0
    assert max(reads for reads, _ in counts) <= CHAIN_LIMIT, counts


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("kind,overrides", [("eagle", ("drafter.tree.nodes=4",)), ("eagle", ("drafter.tree.nodes=16",)),
                                            ("medusa", ("drafter.tree=[[0],[1]]",)), ("medusa", ())])
def test_tree_round_reads_are_independent_of_tree_size(heads, kind, overrides, temperature):
    counts, drafted = reads_per_round(kind, heads, temperature, 4, overrides=overrides)
    assert drafted > 0
    assert max(reads for reads, _ in counts) <= TREE_LIMIT, counts


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lazy_tree_round_reads_once_per_accepted_node(heads, temperature):
    """The CPU's lazy walk computes and reads the root's and each accepted node's row on
    its own (fewer LM-head FLOPs, and a CPU has no stream to stall); never per drafted node."""
    counts, drafted = reads_per_round("eagle", heads, temperature, 4, overrides=("drafter.tree.nodes=16",),
                                      read_once=False)
    assert drafted > 0
    assert all(reads <= TREE_LIMIT - 1 + accepted for reads, accepted in counts), counts


def _propose_the_targets_own_tokens(request, pipe, depth: int, monkeypatch):
    """Make the drafter propose what the target will pick (greedy), so every node is accepted;
    the proposal is computed here, outside the counted round."""
    from specgen.drafters.base import Proposal

    plain = pipe.generate(prompt_ids=list(request.committed.tokens), max_new_tokens=depth, speculative=False).token_ids
    monkeypatch.setattr(request.draft, "propose",
                        lambda budget: Proposal(plain[:budget], None, list(range(-1, min(budget, len(plain)) - 1))))


@pytest.mark.parametrize("depth", [2, 6])
def test_tree_round_reads_with_every_node_accepted(heads, depth, monkeypatch):
    pipe = specgen.pipeline(*FAST, "drafter=eagle", f"drafter.head_file={heads['eagle']}",
                            f"drafter.num_tokens={depth}", "sampling.temperature=0", progress=False)
    pipe.read_once = True
    request, ctx = pipe.open_request(PROMPT, max_new_tokens=200, seed=0)
    speculative_round(request, ctx, depth)
    _propose_the_targets_own_tokens(request, pipe, depth, monkeypatch)
    with counting_reads() as count:
        events = speculative_round(request, ctx, depth)
    assert sum(e.kind == "accepted" for e in events) == depth
    assert count[0] <= TREE_LIMIT, count[0]


@pytest.mark.parametrize("kind", ["tiny", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("gamma", [2, 6])
def test_drafting_reads_independent_of_gamma(heads, kind, temperature, gamma):
    """small_model and MTP keep their drafted tokens on the device (drafters/chain_draw.py)."""
    limit = CHAIN_LIMIT if kind == "tiny" else TREE_LIMIT  # the MTP chain is verified as a tree (target features)
    counts, drafted = reads_per_round(kind, heads, temperature, gamma)
    assert drafted > 0
    assert max(reads for reads, _ in counts) <= limit, counts


@pytest.mark.parametrize("kind", ["tiny", "mtp"])
def test_drafting_under_a_token_reading_processor_reads_each_token(heads, kind):
    """bad_words reads token ids, so each drafted token is read back at its step: the chain's
    reads plus one per drafted token (one more for the planner's confidence read)."""
    gamma = 4
    counts, drafted = reads_per_round(kind, heads, 0.8, gamma, overrides=("sampling.bad_words=[[5,6]]",))
    assert drafted > 0
    limit = CHAIN_LIMIT if kind == "tiny" else TREE_LIMIT
    assert all(reads <= limit + gamma + 1 for reads, _ in counts), counts
    assert max(reads for reads, _ in counts) > limit, counts  # the per-token reads are real
