"""The llguidance backend: an Earley parser + lazy lexer that computes each mask on demand.

llguidance compiles JSON schemas itself (numeric bounds, ``format``, recursive
``$ref``, ``pattern``, min/max lengths and items, ``allOf``, ``patternProperties``)
and bounds its own work per grammar and per token (``LLParserLimits``), so a
pathological schema is refused instead of hanging. Objects that list their
properties get no unlisted keys (:func:`~specgen.grammar.schema_check.strict_objects`).

Its matcher is stateful; here it sits behind the pure interface. A state is a
:class:`PrefixNode`, one per token prefix: interned through its parent (equal
prefixes give the same node while it is alive), holding the matcher's answers
for that prefix (allowed-token bitmask, final). One matcher per grammar is moved
between prefixes with ``rollback``/``consume_token`` under a lock, so a round
that is discarded has nothing to undo: nodes nobody refers to are collected.

Forced text. llguidance spells the bytes a grammar forces with the tokenizer and
allows only that spelling, which is sound only when every forced string can be
spelled exactly. That holds when every byte of UTF-8 text has a one-byte token
(byte-level BPE, SentencePiece byte fallback): those vocabularies are compiled
with forcing. Any other vocabulary is compiled with ``no_forcing``: the mask is
then every token whose bytes the grammar allows, whatever the spelling, which is
what the parser accepts. A grammar whose required opening text no token path
spells is refused at compile (ConfigError, "the tokenizer cannot express this
grammar"); a vocabulary that cannot spell text required later meets a dead end
there (no token allowed), never a token the parser then refuses.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import weakref

import numpy as np
import torch

from specgen.errors import ConfigError, first_line
from specgen.grammar.backend import (
    CompiledAutomaton,
    GrammarBackend,
    compile_progress,
    dist_version,
    strip_anchors,
)
from specgen.grammar.schema_check import Unsupported, check_one_of, check_schema, find_pointer, strict_objects
from specgen.grammar.spec import GrammarSpec
from specgen.grammar.vocabulary import TokenBytes

_WHY = "llguidance does not implement it"
#: Keywords llguidance refuses; named here first so the message carries the JSON pointer.
UNSUPPORTED = dict.fromkeys(
    ["uniqueItems", "contains", "minContains", "maxContains", "if", "then", "else", "not", "dependentRequired",
     "dependentSchemas", "dependencies", "propertyNames", "unevaluatedProperties", "unevaluatedItems"], _WHY)
_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[([^\]]*)\]')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
_KNOWN_DRAFT = re.compile(r"json-schema\.org/(draft-0[3-7]/schema|draft/20(19-09|20-12)/schema)#?$")
_REMOTE = re.compile(r"Resource '([^']+)' is not present in a registry")
#: llguidance's regex syntax error: the pattern on its own line, a caret line, then "error: <reason>".
_REGEX_ERROR = re.compile(r"regex parse error:\s*\n\s*(?P<pattern>[^\n]*)\n[^\n]*\nerror: (?P<reason>[^\n]+)")
#: Every byte that can occur in UTF-8 text (not C0, C1, F5-FF).
_UTF8_BYTES = frozenset(range(0xC0)) | frozenset(range(0xC2, 0xF5))
_NO_FORCING = '%llguidance {"no_forcing": true}\n'
#: llguidance's lexer errors when a regex outgrows its limits (a{60000}: "too many expressions constructed").
_LEXER_LIMIT = re.compile(r"lexer error: .*(too many|limit|fuel)", re.IGNORECASE)
#: Mask computations the compile-time check of a grammar's opening text may spend.
START_CHECK_BUDGET = 256


def can_force(vocab: TokenBytes) -> bool:
    """Whether every byte of UTF-8 text has a one-byte token, so any forced text can be spelled exactly."""
    return _UTF8_BYTES <= {data[0] for data in vocab.by_id if data and len(data) == 1}


def without_forcing(grammar: str) -> str:
    """The llguidance grammar text ``grammar`` (a JSON grammar list) with forcing turned off."""
    top = json.loads(grammar)
    for entry in top["grammars"]:
        schema = entry.get("json_schema")
        if schema is not None:
            entry["json_schema"] = None
            entry["lark_grammar"] = "start: %json " + json.dumps(schema)
        entry["lark_grammar"] = _NO_FORCING + entry["lark_grammar"]
    return json.dumps(top)


class PrefixNode:
    """One token prefix: parent node + last token; answers filled in lazily by the automaton."""

    __slots__ = ("parent", "token", "depth", "serial", "bits", "final", "__weakref__")

    def __init__(self, parent: PrefixNode | None, token: int, serial: int):
        self.parent = parent
        self.token = token
        self.depth = 0 if parent is None else parent.depth + 1
        self.serial = serial
        self.bits: np.ndarray | None = None  # [ceil(vocab / 8)] uint8, little-endian bit order
        self.final = False


class LLGuidanceAutomaton(CompiledAutomaton):
    """A compiled llguidance grammar seen as an automaton over :class:`PrefixNode` states."""

    def __init__(self, matcher, vocab_size: int, description: str):
        self._description = description
        self._pristine = matcher.deep_copy()  # consumed nothing: replaces a matcher that stopped
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._serials = itertools.count(1)
        self._children: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (serial, token) -> node
        self._lock = threading.Lock()
        self.initial_state = PrefixNode(None, -1, 0)
        self._path = [self.initial_state]  # the matcher has consumed the tokens of _path[1:]
        with self._lock:
            self._fill(self.initial_state)

    def next_state(self, state: PrefixNode, token: int) -> PrefixNode | None:
        if not 0 <= token < self._vocab_size or not (state.bits[token >> 3] >> (token & 7)) & 1:
            return None
        key = (state.serial, token)
        with self._lock:
            node = self._children.get(key)
            if node is None:
                node = PrefixNode(state, token, next(self._serials))
                self._children[key] = node
            if node.bits is None:
                self._fill(node)
        return node

    def allowed_mask(self, state: PrefixNode, vocab_size: int) -> torch.Tensor:
        bits = np.unpackbits(state.bits, bitorder="little")[:vocab_size].astype(bool)
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[: len(bits)] = torch.from_numpy(bits)
        return mask  # [vocab_size]

    def allowed_ids(self, state: PrefixNode) -> torch.Tensor:
        return torch.nonzero(self.allowed_mask(state, self._vocab_size)).flatten()

    def is_final(self, state: PrefixNode) -> bool:
        return state.final

    def forced_bytes(self, state: PrefixNode, limit: int) -> bytes:
        """The bytes every continuation of ``state`` starts with (llguidance's fast-forward bytes)."""
        with self._lock:
            self._move_to(state)
            return bytes(self._matcher.compute_ff_bytes())[:limit]

    def _fill(self, node: PrefixNode) -> None:
        """Move the matcher to ``node`` and record its mask and finality (lock held).

        A prefix where nothing is allowed gets an empty mask; llguidance stops
        there for good, so the matcher is replaced by a fresh copy. A regex past
        the lexer's limits raises :class:`Unsupported` (at the initial state: while
        compiling), any other error ConfigError; the matcher is replaced first."""
        self._move_to(node)
        raw = None if self._matcher.is_error() else np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        if self._matcher.is_error():
            error = first_line(ValueError(self._matcher.get_error()))
            self._restart()
            if _LEXER_LIMIT.search(error):
                raise Unsupported(f"{self._description} is too large for grammar.backend=llguidance: a regex in it "
                                  f"expands past the lexer's limit ({error}); use smaller counts ({{n}})")
            if not error.startswith("NoExtensionBias"):  # llguidance's "no token allowed" stop
                raise ConfigError(f"llguidance failed on a prefix it allowed: {error}")
            node.bits = np.zeros((self._vocab_size + 7) // 8, dtype=np.uint8)
            node.final = False
            return
        node.bits = raw[: (self._vocab_size + 7) // 8].copy()
        tail = self._vocab_size & 7
        if tail:
            node.bits[-1] &= (1 << tail) - 1
        node.final = bool(self._matcher.is_accepting())

    def _restart(self) -> None:
        """Replace a stopped matcher by a copy that has consumed nothing (lock held)."""
        self._matcher = self._pristine.deep_copy()
        del self._path[1:]

    def _move_to(self, node: PrefixNode) -> None:
        tokens = []
        walk = node
        while not (walk.depth < len(self._path) and self._path[walk.depth] is walk):
            tokens.append(walk.token)
            walk = walk.parent
        back = len(self._path) - 1 - walk.depth
        if back:
            self._matcher.rollback(back)
            del self._path[walk.depth + 1 :]
        chain = []
        step = node
        while step is not walk:
            chain.append(step)
            step = step.parent
        for child in reversed(chain):
            self._matcher.consume_token(child.token)
            self._path.append(child)


class _Tokenizer:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, EOS, and a tokenize function.

    Tokenizing uses the tokenizer's own ``encode`` when its ids spell exactly the
    text (llguidance allows only that spelling of text the grammar forces), else
    greedy longest match over the vocabulary.

    Ids without text (special tokens, EOS) become llguidance special tokens
    (0xFF prefix); a virtual EOS at ``vocab_size`` ends the grammar's language.
    """

    def __init__(self, vocab: TokenBytes):
        self.tokens = [data if data else b"\xff[SPECIAL_%d]" % i for i, data in enumerate(vocab.by_id)]
        self.tokens.append(b"\xff[EOS]")
        self.eos_token_id = vocab.vocab_size
        self.bos_token_id = None
        self.special_token_ids = [i for i, data in enumerate(self.tokens) if data.startswith(b"\xff")]
        self._by_id = vocab.by_id
        self._encode = vocab.encode
        self._ids = {data: i for i, data in enumerate(vocab.by_id) if data}
        self._longest = max((len(d) for d in self._ids), default=1)

    def __call__(self, text) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if self._encode is not None and isinstance(text, str):
            try:
                ids = self._encode(text)
            except Exception:  # noqa: BLE001 - any failure falls back to greedy spelling
                ids = None
            if ids and all(0 <= i < len(self._by_id) and self._by_id[i] for i in ids) \
                    and b"".join(self._by_id[i] for i in ids) == data:
                return ids
        out, i = [], 0
        while i < len(data):
            for length in range(min(self._longest, len(data) - i), 0, -1):
                token = self._ids.get(data[i : i + length])
                if token is not None:
                    out.append(token)
                    i += length
                    break
            else:
                i += 1
        return out


def unspelled_start(automaton: LLGuidanceAutomaton, vocab: TokenBytes) -> bytes | None:
    """The text every output starts with, when no allowed token path spells it; else None.

    Explores the paths inside that text (a state there depends only on how many
    of its bytes are spelled) for a token that reaches its end or beyond. None
    too when the exploration spends :data:`START_CHECK_BUDGET` mask computations."""
    initial = automaton.initial_state
    if initial.final:
        return None
    forced = automaton.forced_bytes(initial, 256)
    frontier, seen, budget = [(initial, 0)], {0}, START_CHECK_BUDGET
    while frontier:
        state, offset = frontier.pop()
        for token in np.flatnonzero(np.unpackbits(state.bits, bitorder="little")[: vocab.vocab_size]).tolist():
            end = offset + len(vocab.by_id[token])
            if end >= len(forced):
                return None
            if end in seen:
                continue
            budget -= 1
            if budget < 0:
                return None
            seen.add(end)
            frontier.append((automaton.next_state(state, token), end))
    return forced


class LLGuidanceBackend(GrammarBackend):
    """llguidance (see the module docstring)."""

    name = "llguidance"

    def __init__(self):
        import llguidance

        self._llg = llguidance
        self.version = dist_version("llguidance")
        self._tokenizers: dict[str, object] = {}
        self._limits = llguidance.LLParserLimits(verbose_errors=False)

    def check(self, spec: GrammarSpec) -> None:
        if spec.kind == "json_schema":
            schema = spec.schema
            check_schema(schema, UNSUPPORTED, self.name)
            check_one_of(schema, self.name)

    def grammar(self, spec: GrammarSpec) -> str:
        """The llguidance grammar text of ``spec``."""
        llm = self._llg.LLMatcher
        if spec.kind == "regex":
            return llm.grammar_from_regex(strip_anchors(spec.source))
        options = {"whitespace_flexible": False, "coerce_one_of": True, "item_separator": ",",
                   "key_separator": ":", "whitespace_pattern": spec.whitespace or None}
        schema = strict_objects(spec.schema)
        if not _KNOWN_DRAFT.search(str(schema.get("$schema", "https://json-schema.org/draft/2020-12/schema"))):
            schema.pop("$schema")  # an unknown meta-schema URI would be fetched; read it as 2020-12
        try:
            return llm.grammar_from_json_schema(json.dumps(schema), overrides=options)
        except ValueError as exc:
            raise ConfigError(f"invalid JSON schema: {first_line(exc)}") from exc

    def _tokenizer(self, vocab: TokenBytes):
        if vocab.fingerprint not in self._tokenizers:
            if len(self._tokenizers) >= 4:
                self._tokenizers.clear()
            wrapper = self._llg.TokenizerWrapper(_Tokenizer(vocab))
            self._tokenizers[vocab.fingerprint] = self._llg.LLTokenizer(wrapper, slices=None)
        return self._tokenizers[vocab.fingerprint]

    def compile(self, spec: GrammarSpec, vocab: TokenBytes) -> CompiledAutomaton:
        self.check(spec)
        tokenizer = self._tokenizer(vocab)
        grammar = self.grammar(spec)
        if not can_force(vocab):
            grammar = without_forcing(grammar)
        result: dict = {}

        def build() -> None:
            try:
                error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer,
                                                                                     limits=self._limits)
                result["error"] = messages[0] if error else None
                if not error:
                    result["matcher"] = self._llg.LLMatcher(tokenizer, grammar, log_level=0, limits=self._limits)
            except Exception as exc:  # noqa: BLE001 - reported to the caller below
                result["error"] = str(exc)

        with compile_progress(spec.description):
            worker = threading.Thread(target=build, name="llguidance-compile", daemon=True)
            worker.start()
            worker.join(spec.compile_timeout_s)
        if worker.is_alive():
            raise Unsupported(f"{spec.description} did not compile within {spec.compile_timeout_s:g} s with "
                              "grammar.backend=llguidance; simplify the schema or raise grammar.compile_timeout_s")
        matcher = result.get("matcher")
        if matcher is not None and matcher.is_error():
            result["error"] = matcher.get_error()
        if result.get("error"):
            raise self._explain(spec, result["error"])
        automaton = LLGuidanceAutomaton(matcher, vocab.vocab_size, spec.description)
        unspelled = unspelled_start(automaton, vocab)
        if unspelled is not None:
            raise self._nothing_allowed(spec, grammar, unspelled)
        return automaton

    def _nothing_allowed(self, spec: GrammarSpec, grammar: str, text: bytes) -> ConfigError:
        bytes_only = self._llg.LLTokenizer(self._llg.TokenizerWrapper(_Tokenizer(_BYTES)), slices=[])
        matcher = self._llg.LLMatcher(bytes_only, grammar, log_level=0, limits=self._limits)
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)[:32]
        if matcher.is_error() or not (bits.any() or matcher.is_accepting()):
            return ConfigError(f"the grammar matches no string at all (empty language): {spec.description}")
        why = (f"no token sequence spells the text every output starts with "
               f"({text.decode('utf-8', errors='replace')[:80]!r})" if text else "no token can start an output")
        return ConfigError(f"the tokenizer cannot express this grammar: {why}; grammar: {spec.description}")

    def _explain(self, spec: GrammarSpec, message: str) -> ConfigError:
        line = first_line(ValueError(message))
        keys = _UNIMPLEMENTED.search(message)
        if keys and spec.kind == "json_schema":
            names = json.loads(f"[{keys.group(1)}]")
            check_schema(spec.schema, dict.fromkeys(names, _WHY), self.name)
            return Unsupported(f"JSON schema keywords {names} are not supported by grammar.backend=llguidance "
                               f"({spec.description})")
        fmt = _UNKNOWN_FORMAT.search(message)
        if fmt:
            where = find_pointer(spec.schema, lambda s: s.get("format") == fmt.group(1)) or spec.description
            return Unsupported(f"JSON schema keyword 'format' ({fmt.group(1)}) at {where} is not supported by "
                               "grammar.backend=llguidance; remove it or use a 'pattern'")
        bad_regex = _REGEX_ERROR.search(message)
        if bad_regex:
            pattern, reason = bad_regex["pattern"].strip(), bad_regex["reason"].strip()
            where = spec.description
            if spec.kind == "json_schema":
                pointer = find_pointer(spec.schema, lambda s: s.get("pattern") == pattern)
                where = f"{pointer}/pattern of {spec.description}" if pointer else spec.description
            return ConfigError(f"invalid regex {pattern!r} ({reason}) in {where}")
        if spec.kind == "regex":
            return ConfigError(f"invalid or unsupported regex for grammar.backend=llguidance ({line[:160]}): "
                               f"{spec.description}")
        remote = _REMOTE.search(message)
        if remote:
            return ConfigError(f"$ref {remote.group(1)!r} in {spec.description} is not a local reference (#/...): "
                               "remote schemas are not fetched; inline it under $defs")
        if "min/maxProperties" in message:
            where = find_pointer(spec.schema, lambda s: "minProperties" in s or "maxProperties" in s)
            return Unsupported(f"JSON schema keyword 'minProperties'/'maxProperties' at {where} is not supported by "
                               "grammar.backend=llguidance unless every listed property is required")
        if "not supported" in message or "only supported" in message:
            return Unsupported(f"grammar.backend=llguidance cannot compile {spec.description}: {line[:200]}")
        if any(word in message.lower() for word in ("limit", "fuel", "too many", "too large", "exceeded")):
            return Unsupported(f"{spec.description} is too complex for grammar.backend=llguidance "
                               f"({line[:160]}); simplify the schema")
        return ConfigError(f"invalid or unsupported JSON schema for grammar.backend=llguidance: {line[:200]}")


_BYTES = TokenBytes(tuple(bytes([b]) for b in range(256)) + (None,), (256,), "text", "llguidance-bytes")
