"""The sharded, resumable on-disk cache of teacher-forced features.

A corpus is cut, in order, into shards of whole sequences of at least
``shard_tokens`` tokens each (:func:`plan_shards`). Each shard is extracted
with packed forwards (:func:`specgen.train.extract.extract_features`) and
written to ``<cache_dir>/<key>/shard-NNNNN.safetensors`` through a temporary
file and a rename, with its sequence range, token count and a SHA-256 of
every tensor in its metadata. A shard counts as done only when it loads, its
metadata matches the plan and its checksums match, so a run stopped at any
point and started again redoes only the shards that were not complete (a
torn or corrupt file is detected and redone). The key covers the target's
fingerprint, the corpus, the feature layers, the stored dtype and the shard
size, so a cache is never reused for other data. Training reads the shards
back (:func:`load_shards`) as one :class:`specgen.train.data.Features`.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specgen.train.data import Corpus, Features, cache_key
from specgen.train.extract import extract_features

_FIELDS = ("tokens", "hidden", "feature", "lse", "argmax", "lengths")


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """[(first, end)) sequence ranges, in order, each of >= shard_tokens tokens (the last: the rest)."""
    shards, first, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= shard_tokens:
            shards.append((first, i + 1))
            first, tokens = i + 1, 0
    if first < len(lengths):
        shards.append((first, len(lengths)))
    return shards


def _digest(tensors: Mapping[str, torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for name in sorted(tensors):
        sha.update(name.encode())
        sha.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _shard_tensors(feats: Features) -> dict[str, torch.Tensor]:
    out = {"tokens": feats.tokens, "hidden": feats.hidden, "lse": feats.lse, "argmax": feats.argmax,
           "lengths": feats.offsets.diff()}
    if feats.feature is not None:
        out["feature"] = feats.feature
    return {k: v.contiguous() for k, v in out.items()}


def write_shard(path: Path, feats: Features, span: tuple[int, int]) -> None:
    """Write one shard atomically (temporary file, then rename) with its range and checksum."""
    tensors = _shard_tensors(feats)
    meta = {"first": str(span[0]), "end": str(span[1]), "tokens": str(int(feats.tokens.numel())),
            "sha256": _digest(tensors)}
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)


def read_shard(path: Path, span: tuple[int, int], tokens: int) -> dict[str, torch.Tensor] | None:
    """The shard's tensors, or None when it is missing, torn, corrupt or not the planned one."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118  (safe_open has no iterator)
    except (SafetensorError, OSError, ValueError, RuntimeError):
        return None
    if (meta.get("first"), meta.get("end"), meta.get("tokens")) != (str(span[0]), str(span[1]), str(tokens)):
        return None
    if meta.get("sha256") != _digest(tensors):
        return None
    return tensors


def _from_shards(parts: list[dict[str, torch.Tensor]]) -> Features:
    cat = {name: torch.cat([p[name] for p in parts]) for name in _FIELDS if name in parts[0]}
    lengths = cat.pop("lengths")
    return Features(tokens=cat["tokens"], hidden=cat["hidden"], feature=cat.get("feature"), lse=cat["lse"],
                    argmax=cat["argmax"], offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]))


class Progress:
    """One stderr line at most every ``every`` seconds: tokens done, tokens/s of this run, ETA."""

    def __init__(self, total: int, done: int, *, enabled: bool, every: float = 10.0, stream=None):
        self.total, self.done, self.enabled, self.every = total, done, enabled, every
        self.stream = sys.stderr if stream is None else stream
        self.fresh, self.t0 = 0, time.perf_counter()
        self.last, self.shown = self.t0, -1

    def update(self, tokens: int, force: bool = False) -> None:
        self.done += tokens
        self.fresh += tokens
        now = time.perf_counter()
        if not self.enabled or not (force or now - self.last >= self.every) or self.done == self.shown:
            return
        self.last, self.shown = now, self.done
        rate = self.fresh / max(now - self.t0, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        self.stream.write(f"specgen-train: features {self.done:,}/{self.total:,} tokens, {rate:.0f} tokens/s, "
                          f"ETA {eta / 60:.1f} min\n")
        self.stream.flush()


def extract_shards(model, corpus: Corpus, layers: list[int], vocab_size: int, directory: Path | None, *,
                   store_dtype: torch.dtype, shard_tokens: int, batch_tokens: int = 4096, progress: bool = True,
                   max_new_shards: int | None = None) -> tuple[list[dict[str, torch.Tensor]] | None, dict]:
    """Extract every shard not already complete in ``directory`` (None: keep them in memory only).

    Returns (the shards' tensors, info), or (None, info) when ``max_new_shards``
    shards were written and some remain (as an interruption would leave it).
    info: tokens, reused shards, new shards, seconds and tokens/s of the new ones."""
    lengths = [len(s) for s in corpus.sequences]
    spans = plan_shards(lengths, shard_tokens)
    sizes = [sum(lengths[a:b]) for a, b in spans]
    if directory is not None:
        directory.mkdir(parents=True, exist_ok=True)
    paths = [None if directory is None else directory / f"shard-{i:05d}.safetensors" for i in range(len(spans))]
    parts = [None if p is None else read_shard(p, s, n) for p, s, n in zip(paths, spans, sizes)]
    reused = sum(p is not None for p in parts)
    bar = Progress(sum(sizes), sum(n for p, n in zip(parts, sizes) if p is not None), enabled=progress)
    t0, new, new_tokens = time.perf_counter(), 0, 0
    for i, (span, path) in enumerate(zip(spans, paths)):
        if parts[i] is not None:
            continue
        if max_new_shards is not None and new >= max_new_shards:
            return None, {"tokens": sum(sizes), "reused": reused, "new": new, "complete": False}
        feats = extract_features(model, corpus.sequences[span[0]: span[1]], layers, vocab_size,
                                 store_dtype=store_dtype, batch_tokens=batch_tokens, on_batch=bar.update)
        if path is not None:
            write_shard(path, feats, span)
        parts[i] = _shard_tensors(feats)
        new, new_tokens = new + 1, new_tokens + sizes[i]
    bar.update(0, force=new > 0)
    seconds = time.perf_counter() - t0
    return parts, {"tokens": sum(sizes), "reused": reused, "new": new, "complete": True, "seconds": seconds,
                   "tokens_per_s": new_tokens / max(seconds, 1e-9), "shards": len(spans)}


def cached_features(model, corpus: Corpus, layers: list[int], vocab_size: int, fingerprint: Mapping, *,
                    cache_dir: Path | None, store_dtype: torch.dtype = torch.bfloat16, shard_tokens: int = 32768,
                    batch_tokens: int = 4096, progress: bool = True) -> tuple[Features, dict]:
    """Features for ``corpus`` from the shard cache under ``cache_dir`` (None = no cache), extracting what is missing.

    A head that reads the final state only (``layers`` empty) is served from a complete cache of
    the same corpus, target, dtype and shard size extracted for other layers, if one exists: its
    shards hold that final state too. Returns (features, info) with info["cached"] true when
    every shard was already complete."""
    directory = None
    if cache_dir is not None:
        key = cache_key(fingerprint, corpus, layers, store_dtype, shard_tokens)
        final = cache_key(fingerprint, corpus, [], store_dtype, shard_tokens) if layers else key
        directory = Path(cache_dir) / key
        wider = None if layers else _wider_cache(Path(cache_dir), final, exclude=key)
        if wider is not None:
            parts, info = extract_shards(model, corpus, layers, vocab_size, wider, store_dtype=store_dtype,
                                         shard_tokens=shard_tokens, progress=False, max_new_shards=0)
            if parts is not None:
                for part in parts:
                    part.pop("feature", None)
                return _from_shards(parts), dict(info, path=str(wider), cached=True)
    parts, info = extract_shards(model, corpus, layers, vocab_size, directory, store_dtype=store_dtype,
                                 shard_tokens=shard_tokens, batch_tokens=batch_tokens, progress=progress)
    if directory is not None:
        (directory / "corpus.json").write_text(json.dumps({"data": corpus.description, "shards": info["shards"],
                                                           "layers": list(layers), "final_state": final}))
        info["path"] = str(directory)
    info["cached"] = info["new"] == 0
    return _from_shards(parts), info


def _wider_cache(cache_dir: Path, final: str, exclude: str) -> Path | None:
    """A cache directory (other than ``exclude``) whose corpus.json says its shards hold the final
    state keyed ``final`` beside other layers, or None."""
    for meta in sorted(cache_dir.glob("*/corpus.json")):
        if meta.parent.name == exclude:
            continue
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("final_state") == final and info.get("layers"):
            return meta.parent
    return None
