"""Byte-exact token strings of a tokenizer, the input every grammar backend compiles against.

A grammar constrains *bytes*; a tokenizer's vocabulary lists *token strings* in
its own encoding. :func:`token_bytes` turns the loaded tokenizer (no network)
into the exact bytes each id decodes to:

* byte-level BPE (GPT-2, SmolLM2, Qwen, Llama 3): token strings use the
  GPT-2 byte-to-printable-character table (``Ġ`` is the space byte), so a token
  may be a fragment of a multi-byte character;
* SentencePiece style (Llama 2, Mistral): ``▁`` is a space and ``<0xAB>`` byte
  fallback tokens are single bytes;
* plain text (the tiny char tokenizer): the token string is its text.

Special tokens and the EOS ids map to ``None``: a grammar never allows them as
text (EOS is handled separately, see :mod:`specgen.grammar.automaton`).
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from specgen.models.tokenizer import TokenizerInfo

#: Bump when the byte derivation changes, so disk caches keyed on it are rebuilt.
FORMAT_VERSION = 1

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPIECE_SPACE = "\u2581"


@dataclass(frozen=True)
class TokenBytes:
    """by_id: [vocab_size] the bytes of each id, None for ids a grammar never allows.

    style: "byte_level" | "sentencepiece" | "text" (how the bytes were derived).
    fingerprint: identifies vocabulary + special tokens + EOS ids + derivation.
    encode: text -> the tokenizer's own ids for it (no special tokens), or None; a
    backend may use it to spell text the grammar forces the way the model would.
    """

    by_id: tuple[bytes | None, ...]
    eos_ids: tuple[int, ...]
    style: str
    fingerprint: str
    encode: Callable[[str], list[int]] | None = field(default=None, compare=False, repr=False)

    @property
    def vocab_size(self) -> int:
        return len(self.by_id)

    def single_byte_ids(self) -> dict[int, int]:
        """{byte value: the lowest id whose bytes are exactly that one byte}."""
        singles: dict[int, int] = {}
        for token_id, data in enumerate(self.by_id):
            if data is not None and len(data) == 1:
                singles.setdefault(data[0], token_id)
        return singles

    def grouped(self) -> dict[bytes, list[int]]:
        """{token bytes: [ids]} for the allowed ids (several ids may share bytes)."""
        groups: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(self.by_id):
            if data:
                groups.setdefault(data, []).append(token_id)
        return groups


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {ch: b for b, ch in chars.items()}


def _decoder_types(tokenizer) -> set[str]:
    """Types named in the fast tokenizer's decoder (and its Sequence members)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return set()
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return set()
    found: set[str] = set()

    def walk(node) -> None:
        if isinstance(node, dict):
            if "type" in node:
                found.add(str(node["type"]))
                if node.get("type") == "Replace" and _SPIECE_SPACE in json.dumps(node, ensure_ascii=False):
                    found.add("Metaspace")
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(state)
    return found


def _style(tokenizer, tokens: list[str | None]) -> str:
    kinds = _decoder_types(tokenizer)
    if "ByteLevel" in kinds:
        return "byte_level"
    if kinds & {"ByteFallback", "Metaspace"}:
        return "sentencepiece"
    if not kinds and any(t and t.startswith(_SPIECE_SPACE) for t in tokens[:5000]):
        return "sentencepiece"
    return "text"


def _token_strings(tokenizer, vocab_size: int) -> list[str | None]:
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return list(tokenizer.convert_ids_to_tokens(list(range(vocab_size))))
    strings: list[str | None] = [None] * vocab_size
    for text, token_id in tokenizer.get_vocab().items():
        if 0 <= token_id < vocab_size:
            strings[token_id] = text
    return strings


def _added_tokens(tokenizer) -> dict[int, tuple[str, bool]]:
    """{id: (content, special)} for tokens added on top of the model vocabulary."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {int(i): (str(tok.content), bool(getattr(tok, "special", False))) for i, tok in added.items()}


def _decode_token(text: str, style: str) -> bytes:
    if style == "byte_level":
        table = byte_decoder()
        if all(ch in table for ch in text):
            return bytes(table[ch] for ch in text)
        return text.encode("utf-8")
    if style == "sentencepiece":
        fallback = _BYTE_FALLBACK.match(text)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return text.replace(_SPIECE_SPACE, " ").encode("utf-8")
    return text.encode("utf-8")


def _derive(info: TokenizerInfo) -> TokenBytes:
    tokenizer = info.tokenizer
    strings = _token_strings(tokenizer, info.vocab_size)
    style = _style(tokenizer, strings)
    added = _added_tokens(tokenizer)
    never = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []} | set(info.eos_ids)
    never |= {i for i, (_, special) in added.items() if special}
    by_id: list[bytes | None] = []
    for token_id, text in enumerate(strings):
        if token_id in never or text is None:
            by_id.append(None)
        elif token_id in added:
            by_id.append(added[token_id][0].encode("utf-8") or None)
        else:
            by_id.append(_decode_token(text, style) or None)
    fingerprint = f"{info.fingerprint()}-{style}-v{FORMAT_VERSION}"
    encode = getattr(tokenizer, "encode", None)
    return TokenBytes(tuple(by_id), tuple(info.eos_ids), style, fingerprint,
                      None if encode is None else lambda text: list(encode(text, add_special_tokens=False)))


_memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_memo_lock = threading.Lock()


def token_bytes(info: TokenizerInfo) -> TokenBytes:
    """The byte-exact vocabulary of ``info`` (memoised per TokenizerInfo object)."""
    with _memo_lock:
        cached = _memo.get(info)
    if cached is not None:
        return cached
    derived = _derive(info)
    with _memo_lock:
        _memo[info] = derived
    return derived
