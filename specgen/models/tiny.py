"""Tiny random Llama-style models and a matching character tokenizer, built in code.

They need no weights on disk and run in milliseconds, so tests can enumerate
whole output distributions. Two seeds give two different models over the same
vocabulary (a target and a drafter with p != q).
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specgen.models.attention import attention_implementation

#: id 0 is EOS; ids 1.. map to these characters in order.
ALPHABET = " etaoinshrdlucmfwypvbgkjqxz.,!?'\n0123456789ETAOINSHRDLUCMFWYPVBGKJQXZ"


class TinyTokenizer:
    """Character tokenizer over the first ``vocab_size - 1`` characters of ALPHABET.

    Unknown characters encode as a space. Implements the small part of the HF
    tokenizer interface that specgen uses.
    """

    eos_token = "</s>"
    #: Each character of a text is one token (see :attr:`specgen.models.tokenizer.TokenizerInfo.longest_token_chars`).
    longest_token_chars = 1

    def __init__(self, vocab_size: int):
        if not 2 <= vocab_size <= len(ALPHABET) + 1:
            raise ValueError(f"tiny vocab_size must be in [2, {len(ALPHABET) + 1}], got {vocab_size}")
        self.vocab_size = vocab_size
        self.chars = ALPHABET[: vocab_size - 1]
        self.eos_token_id = 0
        self.chat_template = None
        self.all_special_ids = [0]

    def __len__(self) -> int:
        return self.vocab_size

    def get_vocab(self) -> dict[str, int]:
        vocab = {ch: i + 1 for i, ch in enumerate(self.chars)}
        vocab[self.eos_token] = 0
        return vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        index = {ch: i + 1 for i, ch in enumerate(self.chars)}
        return [index.get(ch, 1) for ch in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == 0:
                if not skip_special_tokens:
                    out.append(self.eos_token)
            elif 0 < i < self.vocab_size:
                out.append(self.chars[i - 1])
        return "".join(out)


def build_tiny_model(
    *,
    seed: int,
    vocab_size: int = 16,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    context_length: int = 512,
    init_scale: float = 1.0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama with fixed ``seed`` (deterministic on CPU).

    init_scale multiplies the initialiser range; larger values give peakier
    next-token distributions.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=context_length,
        initializer_range=0.02 * init_scale * 10,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
        tie_word_embeddings=False,
        attn_implementation=attention_implementation(),
    )
    saved_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(saved_state)
    return model.eval()
