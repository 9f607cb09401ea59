"""Hugging Face ``generate()`` baselines on the very models a pipeline holds.

Three methods run here, each on the target's transformers model
(:func:`~specgen.models.target.hf_model_of`; same weights, dtype, device and
threads as specgen), under :func:`hf_kernels`:

``hf_generate``        plain greedy or sampling decoding;
``hf_assisted``        assisted generation with ``assistant_model`` = the
                       pipeline's draft model and a constant number of
                       assistant tokens (gamma) per round;
``hf_prompt_lookup``   prompt-lookup decoding, ``prompt_lookup_num_tokens`` = gamma.

In transformers 5 the assistant's round size and early stop are read from the
*assistant's* ``generation_config`` (``num_assistant_tokens``,
``num_assistant_tokens_schedule``, ``assistant_confidence_threshold``), not from
the ``generate()`` arguments; :func:`assistant_settings` sets them for one call
(constant schedule, no confidence early stop) and restores them afterwards.

``bench.hf_kernels`` chooses the kernels HF runs on: ``stock`` (the default) is
transformers as users run it, ``nn.Linear`` and its ``sdpa`` attention;
``specgen`` lends HF specgen's packed linear layers and packed grouped-query
attention, so a comparison isolates how tokens are planned from how fast one
forward is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager

import torch
from transformers.generation.streamers import BaseStreamer

from specgen.models.target import hf_model_of

HF_METHODS = ("hf_generate", "hf_assisted", "hf_prompt_lookup")
HF_KERNELS = ("stock", "specgen")
_ASSISTANT_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")


def unsupported_sampling(sampling: Mapping) -> str | None:
    """Why HF ``generate()`` cannot reproduce these sampling settings, or None when it can."""
    if float(sampling.get("presence_penalty") or 0) or float(sampling.get("frequency_penalty") or 0):
        return "presence/frequency penalties have no HF generate() equivalent"
    if sampling.get("bad_words"):
        return "bad_words are given as strings; HF generate() needs token ids"
    return None


def hf_unavailable(pipe) -> str | None:
    """Why HF ``generate()`` cannot run what ``pipe`` runs (a grammar, or sampling it cannot
    reproduce), or None when it can."""
    if hf_model_of(pipe.target) is None:
        return (f"the target runs on {pipe.target.backend}, without a transformers model; HF generate() needs "
                "backend=torch with a float dtype")
    grammar = (pipe.config.grammar or {}).get("kind", "none")
    if grammar != "none":
        return f"HF generate() has no equivalent of grammar={grammar}"
    return unsupported_sampling(pipe.config.sampling)


def generate_kwargs(sampling: Mapping, *, temperature: float, max_new_tokens: int, ignore_eos: bool,
                    eos_ids: Sequence[int]) -> dict:
    """``generate()`` keyword arguments equivalent to specgen's sampling config.

    Every knob is set explicitly, so a model's own ``generation_config`` defaults
    (e.g. a checkpoint's top_k=50 or do_sample=True) cannot change the method.
    ignore_eos: EOS is masked until ``max_new_tokens`` (like ``sampling.min_new_tokens``).
    """
    eos = list(eos_ids) or None
    kwargs = {
        "max_new_tokens": int(max_new_tokens),
        "min_new_tokens": int(max_new_tokens) if ignore_eos else 0,
        "eos_token_id": eos,
        "pad_token_id": eos[0] if eos else None,
        "repetition_penalty": float(sampling.get("repetition_penalty") or 1.0),
        "no_repeat_ngram_size": 0,
        "do_sample": temperature > 0,
    }
    if temperature > 0:
        kwargs.update(temperature=float(temperature), top_k=int(sampling.get("top_k") or 0),
                      top_p=float(sampling.get("top_p") or 1.0), min_p=float(sampling.get("min_p") or 0.0) or None)
    return kwargs


@contextmanager
def assistant_settings(assistant: torch.nn.Module, gamma: int):
    """Constant ``gamma`` assistant tokens per round, no confidence early stop, for one call."""
    config = assistant.generation_config
    saved = {key: getattr(config, key, None) for key in _ASSISTANT_KEYS}
    config.num_assistant_tokens = int(gamma)
    config.num_assistant_tokens_schedule = "constant"
    config.assistant_confidence_threshold = 0.0
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


@contextmanager
def hf_kernels(models: Sequence[torch.nn.Module | None], kernels: str):
    """Run the HF methods on ``kernels`` (one of HF_KERNELS) for the models given; None entries are skipped.

    ``stock`` switches every :class:`~specgen.models.packed_linear.PackedLinear` to
    ``F.linear`` (its packed copy is kept, so specgen's next forward does not
    repack) and the attention implementation to transformers' ``sdpa``; both are
    restored on exit, also on error.
    """
    if kernels not in HF_KERNELS:
        raise ValueError(f"unknown HF kernels {kernels!r}; expected one of {HF_KERNELS}")
    held = [m for m in models if m is not None]
    if kernels == "specgen" or not held:
        yield
        return
    from specgen.models import packed_linear

    attention = [(model, model.config._attn_implementation) for model in held]
    with packed_linear.suspended(held):
        try:
            for model, _ in attention:
                model.set_attn_implementation("sdpa")
            yield
        finally:
            for model, name in attention:
                model.set_attn_implementation(name)


class FirstTokenTimer(BaseStreamer):
    """Streamer that records when ``generate()`` pushes its first new token.

    ``generate()`` pushes the prompt first, then new tokens; the second push is
    the first output token.
    """

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.pushes = 0
        self.first_token_at: float | None = None

    def put(self, value) -> None:
        self.pushes += 1
        if self.pushes == 2:
            self.first_token_at = self.clock()

    def end(self) -> None:
        """Nothing to flush."""


def run_hf(method: str, model: torch.nn.Module, prompt_ids: Sequence[int], kwargs: Mapping, *,
           clock: Callable[[], float], seed: int, gamma: int | None = None,
           assistant: torch.nn.Module | None = None, max_ngram: int = 3, kernels: str = "stock") -> dict:
    """Run one HF method on one prompt; return ``{token_ids, wall, ttft}``.

    kernels: see :func:`hf_kernels` (switched before the clock starts).
    clock: a synchronising timer (CUDA is synchronised before each reading).
    The global torch RNG is seeded with ``seed`` (HF samples from it).
    """
    if method not in HF_METHODS:
        raise ValueError(f"unknown HF method {method!r}; expected one of {HF_METHODS}")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # [1, prompt_len]
    call = dict(kwargs, input_ids=ids, attention_mask=torch.ones_like(ids))
    if method == "hf_prompt_lookup":
        call.update(prompt_lookup_num_tokens=int(gamma), max_matching_ngram_size=int(max_ngram))
    if method == "hf_assisted":
        if assistant is None:
            raise ValueError("hf_assisted needs the draft model as assistant")
        call.update(assistant_model=assistant)
    torch.manual_seed(seed)
    timer = FirstTokenTimer(clock)
    call["streamer"] = timer
    with torch.inference_mode(), hf_kernels((model, assistant), kernels):
        if method == "hf_assisted":
            with assistant_settings(assistant, gamma):
                start = clock()
                output = model.generate(**call)
                end = clock()
        else:
            start = clock()
            output = model.generate(**call)
            end = clock()
    new_ids = output[0, ids.shape[1]:].tolist()
    ttft = None if timer.first_token_at is None else timer.first_token_at - start
    return {"token_ids": new_ids, "wall": end - start, "ttft": ttft}

