"""Tree drafters (EAGLE, Medusa) draft from the masked draft distribution under a grammar.

Every drafted node is a token the grammar allows after its path, ranked among the
allowed tokens by the head's logits; speculation stays exact (chi-square against
the enumerated target distribution, with a broken-final-draw negative control) and
greedy speculation equals plain greedy. Tiny random target (vocabulary 8) and tiny
random heads; char-level regex grammar; fixed seeds.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import TINY
from exact import exact_distribution, goodness_of_fit, sample_counts

import specgen
from specgen.grammar import TokenAutomaton, grammar_processor
from specgen.heads import HeadConfig, build_head, save_head, target_fingerprint
from specgen.engine.round import speculative_round
from specgen.sampling import sample_token
from specgen.sampling import tree as tree_sampling

#: Over the tiny alphabet (EOS=0, e=2, t=3, a=4, n=7): a choice at the first token, then forced
#: tokens, then up to three free [en] tokens and EOS.
REGEX = "(at|ta)[en]{0,3}"
PROMPT = [1, 2, 3]
PROMPTS = ([1, 2, 3], [5], [4, 3, 1, 4], [1, 1, 1], [6, 2], [2])
LENGTH = 6
NUM_SAMPLES = 1200
MIN_P_VALUE = 1e-3
KINDS = ["eagle", "medusa"]


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    """Random float32 EAGLE and Medusa heads over the whole 8-token vocabulary of the tiny target."""
    base = tmp_path_factory.mktemp("tree-grammar-heads")
    model = specgen.pipeline(*TINY, "target.source.vocab_size=8", "drafter=none", progress=False).target.model
    d = model.config.hidden_size
    out = {}
    for name, kind, vocab in (*((k, k, 8) for k in KINDS), *((f"{k}-small", k, 4) for k in KINDS)):
        torch.manual_seed(1)
        head = build_head(HeadConfig(kind=kind, hidden_size=d, draft_vocab_size=vocab, intermediate_size=2 * d,
                                     num_heads=4), torch.arange(vocab))
        with torch.no_grad():
            for param in head.parameters():
                param.normal_(0.0, 0.3)
        out[name] = str(save_head(base / f"{name}.safetensors", head, target_fingerprint(model), dtype=torch.float32))
    return out


def pipeline(kind: str, heads, *overrides: str, grammar: bool = True, head: str | None = None):
    pipe = specgen.pipeline(*TINY, "target.source.vocab_size=8", f"drafter={kind}",
                            f"drafter.head_file={heads[head or kind]}", "drafter.num_tokens=3", *overrides,
                            progress=False)
    if grammar:
        pipe.stack = pipe.stack.with_grammar(grammar_processor({"kind": "regex", "pattern": REGEX}, pipe.tokenizer))
    return pipe


def drafted_trees(pipe, prompt: list[int], raw: bool = False):
    """Yield (request, proposal) before each round of one run that can draft (the session has
    the target feature of the last committed position); ``raw`` drafts
    as if the stack had no grammar (the ranking by raw head logits, the old behaviour)."""
    request, ctx = pipe.open_request(prompt, max_new_tokens=LENGTH, seed=0)
    if raw:
        request.draft.grammar = None
    while request.finish_reason is None:
        remaining = min(3, request.remaining - 1)
        if remaining > 0 and request.draft.root(remaining) is not None:
            yield request, request.draft.propose(remaining)
        speculative_round(request, ctx, 3)


def forbidden_nodes(pipe, request, proposal) -> int:
    """How many nodes of ``proposal`` the grammar forbids after their path (from the committed tokens)."""
    automaton = pipe.stack.processors[0].automaton
    generated = request.committed.tokens[request.committed.num_prompt :]
    bad = 0
    for node, token in enumerate(proposal.tokens):
        path = [token]
        while proposal.parents[node] >= 0:
            node = proposal.parents[node]
            path.insert(0, proposal.tokens[node])
        bad += automaton.state_after(generated + path) is None
    return bad


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_every_drafted_node_is_allowed_by_the_grammar(kind, temperature, heads):
    pipe = pipeline(kind, heads, f"sampling.temperature={temperature}")
    drafted = forbidden = raw_forbidden = 0
    for prompt in PROMPTS:
        for request, proposal in drafted_trees(pipe, prompt):
            drafted += len(proposal)
            forbidden += forbidden_nodes(pipe, request, proposal)
        for request, proposal in drafted_trees(pipe, prompt, raw=True):
            raw_forbidden += forbidden_nodes(pipe, request, proposal)
    assert drafted > 20 and forbidden == 0
    assert raw_forbidden > 0, "non-vacuous: ranking by raw head logits drafts forbidden nodes"


@pytest.mark.parametrize("kind", KINDS)
def test_a_draft_vocabulary_without_allowed_tokens_drafts_nothing(kind, heads):
    """A head over ids 0..3 (EOS, ' ', e, t) cannot draft the 'a' the grammar requires after 't':
    such rounds propose nothing (instead of forbidden nodes), and greedy output is unchanged."""
    pipe = pipeline(kind, heads, "sampling.temperature=0", head=f"{kind}-small")
    empty = drafted = 0
    for prompt in PROMPTS:
        for request, proposal in drafted_trees(pipe, prompt):
            assert forbidden_nodes(pipe, request, proposal) == 0
            assert all(token < 4 for token in proposal.tokens)
            empty += len(proposal) == 0
            drafted += len(proposal)
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=LENGTH, speculative=False)
        assert pipe.generate(prompt_ids=prompt, max_new_tokens=LENGTH).token_ids == plain.token_ids
    assert empty > 0 and drafted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_children_are_the_best_allowed_tokens_by_head_logits(kind, heads):
    """The root's children are the allowed tokens ranked by the head's raw logits (masking and
    renormalising keeps the order among allowed tokens), as many as the tree has slots for."""
    pipe = pipeline(kind, heads, "sampling.temperature=1.0")
    automaton = pipe.stack.processors[0].automaton
    checked = 0
    for prompt in PROMPTS:
        for request, proposal in drafted_trees(pipe, prompt):
            session = request.draft
            feature, token = session.root(1)
            with torch.inference_mode():
                if kind == "eagle":
                    logits = session.head.step(feature, torch.tensor([token]))[1][0]  # [Vd]
                    slots = session.drafter.top_k
                else:
                    logits = session.head(feature)[0, 0]  # [Vd] head 0
                    slots = sum(len(p) == 1 for p in session.drafter.tree)
            state = automaton.state_after(request.committed.tokens[request.committed.num_prompt :])
            ranked = sorted(automaton.allowed(state), key=lambda t: -float(logits[t]))[:slots]
            roots = [t for t, parent in zip(proposal.tokens, proposal.parents, strict=True) if parent < 0]
            if kind == "eagle":  # the rerank may drop unlikely children; the kept ones lead the ranking
                assert roots and sorted(roots, key=ranked.index) == ranked[: len(roots)]
            else:
                assert roots == ranked
            checked += 1
    assert checked > 5


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tree_speculation_equals_plain_under_a_grammar(kind, heads):
    pipe = pipeline(kind, heads, "sampling.temperature=0")
    assert str(pipe.guarantee) == "greedy"
    accepted = 0
    for prompt in PROMPTS:
        plain = pipe.generate(prompt_ids=prompt, max_new_tokens=LENGTH, speculative=False)
        spec = pipe.generate(prompt_ids=prompt, max_new_tokens=LENGTH)
        assert (spec.token_ids, spec.finish_reason) == (plain.token_ids, plain.finish_reason), prompt
        accepted += spec.stats.accepted
    assert accepted > 0, "non-vacuous: some drafted nodes are accepted"


@pytest.mark.parametrize("kind", KINDS)
def test_tree_drafting_under_a_grammar_is_charged_to_the_grammar_stage(kind, heads, monkeypatch):
    """With every mask and transition SLOW fake seconds, the tree's grammar work lands in
    "grammar" (one mask-time sample per expanded node), none of it in draft or process."""
    slow_s, offset = 100.0, [0.0]
    pipe = pipeline(kind, heads, "sampling.temperature=0")
    for name in ("mask", "advance"):
        original = getattr(TokenAutomaton, name)

        def slow(self, *args, original=original, **kwargs):
            offset[0] += slow_s
            return original(self, *args, **kwargs)

        monkeypatch.setattr(TokenAutomaton, name, slow)
    request, ctx = pipe.open_request(PROMPT, max_new_tokens=LENGTH, seed=0)
    ctx.clock.timer = lambda: time.perf_counter() + offset[0]
    while request.finish_reason is None:
        speculative_round(request, ctx, 3)
    timings = ctx.stats.timings
    assert ctx.stats.drafted > 0 and timings.grammar >= slow_s and len(ctx.stats.mask_seconds) > 0
    assert timings.draft < slow_s and timings.process < slow_s
    assert offset[0] <= timings.grammar < offset[0] + slow_s, "every slowed call is grammar work"


#: Exactness cases: EAGLE with two children per node (test_grammar_backends covers its default tree
#: under the same regex), Medusa with its default tree; both leave allowed tokens undrafted below the root.
EXACT_CASES = [("eagle", ("drafter.tree.top_k=2",)), ("medusa", ())]


@pytest.mark.parametrize("kind,overrides", EXACT_CASES)
def test_sampled_tree_speculation_is_exact_under_a_grammar(kind, overrides, heads):
    pipe = pipeline(kind, heads, "sampling.temperature=1.0", *overrides)
    assert str(pipe.guarantee) == "exact"
    expected = exact_distribution(pipe, PROMPT, LENGTH)
    counts = sample_counts(pipe, PROMPT, LENGTH, NUM_SAMPLES)
    assert pipe.generate(prompt_ids=PROMPT, max_new_tokens=LENGTH, seed=0).stats.drafted > 0
    p_value, tv = goodness_of_fit(counts, expected)
    assert p_value > MIN_P_VALUE, f"{kind}: chi-square p={p_value:.2e}, TV={tv:.3f}"


@pytest.mark.parametrize("kind,overrides", EXACT_CASES)
def test_negative_control_detects_a_final_draw_from_p(kind, overrides, heads, monkeypatch):
    """Drawing afresh from p (rejected children not removed) after every child is rejected must
    fail the same test: in the coupled walk, a fresh draw from the row instead of the drawn token."""
    pipe = pipeline(kind, heads, "sampling.temperature=1.0", *overrides)
    expected = exact_distribution(pipe, PROMPT, LENGTH)
    coupled_levels, rng = tree_sampling.coupled_levels, torch.Generator().manual_seed(0)

    def draw_from_p(draw, children, tokens):
        decide = coupled_levels(draw, children, tokens)

        def fresh_final_draw(node, row, level, depth, checked, accept_probs):
            child, next_token = decide(node, row, level, depth, checked, accept_probs)
            return (child, None) if child is not None else (None, sample_token(row, rng))  # row: [vocab] p

        return fresh_final_draw

    monkeypatch.setattr(tree_sampling, "coupled_levels", draw_from_p)
    counts = sample_counts(pipe, PROMPT, LENGTH, NUM_SAMPLES)
    p_value, _ = goodness_of_fit(counts, expected)
    assert p_value < MIN_P_VALUE
