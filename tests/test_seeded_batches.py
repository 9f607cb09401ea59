"""What a seed reproduces when requests share batched forwards (README, "Seeds and batching").

- Temperature 0: every row equals its request run alone, token for token (tests/test_batch.py,
  tests/test_batch_planner.py).
- Temperature > 0 with a fixed drafter.num_tokens: a seeded row draws exactly the random numbers
  of its request run alone, so its tokens do not depend on which rows share its batch.
- Temperature > 0 with num_tokens=auto: the batch planner picks each row's draft length from the
  batch's shape, so a row follows its request's exact law (tests/test_batch_planner.py) and the
  same batch, in the same order, with the same cost table, repeats token for token.
"""

from __future__ import annotations

from conftest import tiny_pipeline

SEEDS = (3, 11, 29, 47)


def _requests(seeds, max_new_tokens=8):
    return [dict(prompt_ids=[1 + s % 7, 2, 3], seed=s, max_new_tokens=max_new_tokens) for s in seeds]


def _fillers(count, first_seed):
    """Other rows of other lengths and seeds, to change the batch around the seeded ones."""
    return [dict(prompt_ids=[5, 6, 7, 8][: 1 + i % 4], seed=first_seed + i, max_new_tokens=3 + 4 * (i % 3))
            for i in range(count)]


def test_fixed_draft_length_rows_do_not_depend_on_their_batch():
    pipe = tiny_pipeline("sampling.temperature=1.0", "drafter.num_tokens=3")
    alone = [pipe.generate(**r).token_ids for r in _requests(SEEDS)]
    small = pipe.generate_batch(_requests(SEEDS) + _fillers(3, 100), batch_size=2)[: len(SEEDS)]
    mixed = _fillers(5, 200) + _requests(reversed(SEEDS))
    large = pipe.generate_batch(mixed, batch_size=6)[5:][::-1]
    assert [g.token_ids for g in small] == alone
    assert [g.token_ids for g in large] == alone
    assert sum(g.stats.drafted for g in large) > 0, "the rows must speculate"
    assert len({tuple(t) for t in alone}) > 1, "different seeds, different samples"


def test_auto_draft_length_batches_repeat_for_the_same_composition():
    pipe = tiny_pipeline("sampling.temperature=1.0")
    assert pipe.drafter.num_tokens == "auto" and str(pipe.guarantee) == "exact"
    requests = _requests(SEEDS, max_new_tokens=12) + _fillers(4, 300)
    first = [g.token_ids for g in pipe.generate_batch(requests, batch_size=4)]
    again = [g.token_ids for g in pipe.generate_batch(requests, batch_size=4)]
    assert first == again
    assert len({tuple(t) for t in first}) > 1
