"""Run a Hugging Face ``LogitsProcessor`` inside a specgen stack.

HF processors see ``(input_ids, scores)`` and may keep hidden state, so specgen
cannot know whether evaluating one on a hypothetical (drafted) history is the
same as evaluating it after those tokens were really generated. Such a processor
is marked impure unless the config declares ``pure: true``; an impure processor
turns exact speculation off (plain decoding still uses it).
"""

from __future__ import annotations

import torch

from specgen.processors.history import History
from specgen.processors.standard import Processor


class HFProcessorAdapter(Processor):
    name = "hf"
    host_tokens = True

    def __init__(self, processor, pure: bool = False):
        self.processor = processor
        self.pure = bool(pure)
        self.name = f"hf:{type(processor).__name__}"

    def __call__(self, logits, history: History):
        rows = []
        for position in range(logits.shape[0]):
            ids = torch.tensor([history.full(position)], dtype=torch.long, device=logits.device)
            rows.append(self.processor(ids, logits[position : position + 1].clone())[0])
        return torch.stack(rows)

    def __repr__(self) -> str:
        return f"{self.name}(pure={self.pure})"
