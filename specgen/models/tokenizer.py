"""Prompt encoding, EOS ids and vocabulary comparison around a tokenizer."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property

from specgen.errors import PromptError
from specgen.models.prefix_cache import common_prefix

Messages = Sequence[dict]

#: Placeholder names GGUF conversion gives to embedding rows that have no token (Qwen pads 151665..151935).
_PLACEHOLDER = re.compile(r"\[PAD\d+\]")


def real_vocab_size(tokenizer) -> int:
    """``len(tokenizer)`` minus a trailing run of placeholder ids that stand for no token."""
    size = len(tokenizer)
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None:
        return size
    while size > 0 and _PLACEHOLDER.fullmatch(str(convert(size - 1) or "")):
        size -= 1
    return size


#: Two texts whose renderings part where they start (:meth:`TokenizerInfo.next_turn_ids`, ``typed_prefix_ids``).
_PROBES = ("Hello", "Why")


def _before_probes(render: Callable[[str], list[int]]) -> list[int]:
    """The ids ``render`` gives before the text it is passed, for any text: the common prefix of its
    renderings of the two :data:`_PROBES`; [] where it raises (a template that refuses the conversation,
    e.g. an alternation check)."""
    try:
        first, second = (render(text) for text in _PROBES)
    except Exception:
        return []
    return first[:common_prefix(first, second)]


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    """``messages`` with a leading system message ``system`` unless they start with one."""
    if system and (not messages or messages[0].get("role") != "system"):
        return [{"role": "system", "content": system}, *messages]
    return messages


class TokenizerInfo:
    """Wraps an HF tokenizer (or :class:`~specgen.models.tiny.TinyTokenizer`).

    vocab_size: number of ids that have a token (``len(tokenizer)`` without
        trailing placeholder ids); logits are cut to this width on both sides.
    eos_ids: every id that ends generation (tokenizer EOS + generation config EOS).

    Encoding (prompts, chat templates, word variants) holds a lock: a fast tokenizer may set its
    truncation and padding state per call, and two threads doing so at once fail ("Already
    borrowed"); the prefix cache's settle thread renders the next turn while a request encodes.
    """

    def __init__(self, tokenizer, extra_eos: Iterable[int] = ()):
        self.tokenizer = tokenizer
        self._encoding = threading.Lock()
        self.vocab_size = real_vocab_size(tokenizer)
        eos = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
        self.eos_ids = sorted({int(i) for i in [*eos, *extra_eos] if i is not None and int(i) < self.vocab_size})
        # A fast tokenizer that cleans up no spaces decodes to what its Rust backend does, without
        # transformers' per-call conversions (decode runs twice per committed token).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", True)
        self._backend = backend if backend is not None and not cleans_up else None

    @cached_property
    def longest_token_chars(self) -> int | None:
        """The most characters of a text one token of an encoding stands for, so a text of n
        characters has at least n / longest_token_chars tokens; None when that is not known: the
        tokenizer may drop characters before it splits them (a normalizer, a whitespace-dropping
        pre-tokenizer, special tokens that strip their neighbours' whitespace). Known for fast
        tokenizers without those (the longest text of one token, each decoded alone) and for
        tokenizers that declare it (``longest_token_chars``)."""
        declared = getattr(self.tokenizer, "longest_token_chars", None)
        if declared is not None:
            return int(declared)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or backend.normalizer is not None or _drops_text(backend.pre_tokenizer):
            return None
        if any(t.lstrip or t.rstrip for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values()):
            return None
        return max(len(backend.decode([i], skip_special_tokens=False)) for i in range(self.vocab_size))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode_prompt(self, prompt: str | Messages, *, chat: bool | str = "auto", system: str | None = None) -> list[int]:
        """Token ids for a prompt string or a list of chat messages.

        chat: True applies the chat template (error if there is none), False encodes
        the raw text, "auto" applies it when the tokenizer has one.
        """
        use_chat = self.has_chat_template if chat == "auto" else bool(chat)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = list(prompt)
            if not use_chat:
                raise PromptError("a list of chat messages needs a tokenizer with a chat template")
        if use_chat:
            if not self.has_chat_template:
                raise PromptError("chat=true but this tokenizer has no chat template; use chat=false")
            return self._render(_with_system(messages, system), generation_prompt=True)
        text = prompt if system is None else f"{system}\n\n{prompt}"
        return self._encode(text)

    def next_turn_ids(self, messages: Messages, reply: str, *, system: str | None = None) -> list[int]:
        """What the next turn's prompt begins with: the chat template's ids for ``messages`` (with
        ``system`` as :meth:`encode_prompt` adds it), then the assistant's ``reply`` and a user
        message, up to where that message's content starts (the common prefix of two renderings
        with different messages). [] where the tokenizer has no chat template or it cannot render
        that conversation."""
        if not self.has_chat_template:
            return []
        history = [*_with_system(list(messages), system), {"role": "assistant", "content": reply}]
        return _before_probes(lambda text: self._render([*history, {"role": "user", "content": text}],
                                                        generation_prompt=False))

    def typed_prefix_ids(self, prompt: str | Messages, *, chat: bool | str = "auto",
                         system: str | None = None) -> list[int]:
        """What a prompt whose last message (or text) is still being typed will begin with: its ids as
        :meth:`encode_prompt` gives them, the message cut after its last whitespace (the word being
        typed dropped), up to where two renderings continuing it with different words part. [] where
        the prompt's last message is not the user's or the template cannot render it."""
        if isinstance(prompt, str):
            head = _typed_head(prompt)
            return _before_probes(lambda text: self.encode_prompt(head + text, chat=chat, system=system))
        messages = list(prompt)
        if not messages or messages[-1].get("role") != "user" or not isinstance(messages[-1].get("content"), str):
            return []
        head, rest = _typed_head(messages[-1]["content"]), messages[:-1]
        return _before_probes(lambda text: self.encode_prompt([*rest, {"role": "user", "content": head + text}],
                                                              chat=chat, system=system))

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> list[int]:
        with self._encoding:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def _encode(self, text: str) -> list[int]:
        with self._encoding:
            return [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=True)
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_ids(self, word: str) -> list[list[int]]:
        """Id sequences a word may appear as (bare and with a leading space), for bad words."""
        variants = []
        for text in (word, " " + word):
            ids = self._encode(text)
            if ids and ids not in variants:
                variants.append(ids)
        return variants

    def fingerprint(self) -> str:
        """Hash of the vocabulary, special tokens and EOS ids."""
        payload = {
            "vocab": sorted(self.tokenizer.get_vocab().items()),
            "special": sorted(int(i) for i in getattr(self.tokenizer, "all_special_ids", [])),
            "eos": self.eos_ids,
        }
        return hashlib.sha256(json.dumps(payload).encode()).hexdigest()[:16]

    def mismatch(self, other: TokenizerInfo) -> str | None:
        """None when both sides map every id to the same token; else the first difference."""
        if self.vocab_size != other.vocab_size:
            return f"vocab sizes differ ({self.vocab_size} vs {other.vocab_size})"
        mine, theirs = self.tokenizer.get_vocab(), other.tokenizer.get_vocab()
        if mine != theirs:
            diff = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            return f"vocabularies differ, e.g. {diff}"
        if self.eos_ids != other.eos_ids:
            return f"EOS ids differ ({self.eos_ids} vs {other.eos_ids})"
        mine_special = sorted(getattr(self.tokenizer, "all_special_ids", []))
        theirs_special = sorted(getattr(other.tokenizer, "all_special_ids", []))
        if mine_special != theirs_special:
            return f"special tokens differ ({mine_special} vs {theirs_special})"
        return None


def _typed_head(text: str) -> str:
    """``text`` up to and with its last whitespace: the words a typist has finished."""
    cut = max((i for i, c in enumerate(text) if c.isspace()), default=-1)
    return text[:cut + 1]


def _drops_text(pre_tokenizer) -> bool:
    """Whether a tokenizers pre-tokenizer may drop characters (whitespace splitting, a split that removes
    its pattern) instead of only cutting the text into pieces."""
    if pre_tokenizer is None:
        return False
    spec = json.dumps(json.loads(pre_tokenizer.__getstate__()))
    return any(word in spec for word in ('"Whitespace', '"WhitespaceSplit', '"BertPreTokenizer', '"Removed"'))
