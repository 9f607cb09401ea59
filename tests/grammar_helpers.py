"""Test helpers for grammar tests: character tokenizers, offline HF tokenizers, histories."""

from __future__ import annotations

import pathlib

import torch

from specgen.models.tiny import TinyTokenizer
from specgen.models.tokenizer import TokenizerInfo
from specgen.processors import CommittedCounts, History

GRAMMARS = pathlib.Path(__file__).resolve().parent.parent / "grammars"
PRINTABLE_ASCII = "".join(chr(c) for c in range(32, 127))


class CharTokenizer(TinyTokenizer):
    """A TinyTokenizer over arbitrary characters: id 0 is EOS, id i the (i-1)-th character."""

    def __init__(self, chars: str):
        super().__init__(2)
        self.chars = chars
        self.vocab_size = len(chars) + 1


def char_info(chars: str, *, eos: bool = True) -> TokenizerInfo:
    info = TokenizerInfo(CharTokenizer(chars))
    if not eos:
        info.eos_ids = []
    return info


def history(info: TokenizerInfo, prompt: list[int], generated: list[int], candidates: list[int] = (),
            num_positions: int | None = None, start: int = 0) -> History:
    """Rows for committed prompt + generated tokens followed by ``candidates``."""
    counts = CommittedCounts.start(prompt, info.vocab_size, torch.device("cpu"))
    counts.commit(list(generated))
    rows = len(candidates) + 1 - start if num_positions is None else num_positions
    return History(counts, list(candidates), rows, start=start)


def allowed_rows(logits: torch.Tensor) -> list[list[int]]:
    """The finite (allowed) ids of each row of processed logits [N, vocab]."""
    return [torch.nonzero(torch.isfinite(row)).flatten().tolist() for row in logits]


def byte_level_tokenizer():
    """A small GPT-2 style byte-level BPE tokenizer trained in code (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"])
    corpus = ["café naïve résumé 日本語 🙂 hello world", '{"name": "Zoë", "city": "Zürich"}']
    tok.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def sentencepiece_tokenizer():
    """A Llama-2 style tokenizer: '▁' for spaces and <0xXX> byte-fallback tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "b", "c", "▁a", "ab", "▁ab"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "a"), ("a", "b"), ("▁", "ab")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def order_model(*, sku_max: int | None = None, lines_max: int = 3, note_max: int | None = None):
    """A pydantic order with Field(ge, le), conint, a datetime, an Enum, a nested list of
    models and an Optional (the issue's schema); the length bounds keep outputs short on
    small vocabularies. Skips the test when pydantic is missing."""
    import datetime
    import enum

    import pytest

    pydantic = pytest.importorskip("pydantic")

    class Status(enum.Enum):
        open = "open"
        shipped = "shipped"

    class Line(pydantic.BaseModel):
        sku: str = pydantic.Field(max_length=sku_max)
        qty: pydantic.conint(ge=1, le=99)

    class Order(pydantic.BaseModel):
        rating: int = pydantic.Field(ge=1, le=5)
        placed: datetime.datetime
        status: Status
        lines: list[Line] = pydantic.Field(max_length=lines_max)
        note: str | None = pydantic.Field(default=None, max_length=note_max)

    return Order
