"""Per-request metrics of a generation: acceptance, calls and a time split."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch


class Clock:
    """perf_counter that synchronises CUDA first, so GPU work is timed where it runs."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


@dataclass
class Timings:
    """Seconds spent in each stage of the rounds."""

    draft: float = 0.0
    verify: float = 0.0
    process: float = 0.0
    commit: float = 0.0


@dataclass
class Stats:
    """rounds: speculative rounds (or plain steps). target_calls: target forwards.
    drafted / accepted: draft tokens proposed / kept. proposed_per_position[i] and
    accepted_per_position[i]: the same for draft position i + 1.
    """

    rounds: int = 0
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    ttft: float | None = None
    wall: float = 0.0
    drafter_memory_bytes: int = 0

    def record_round(self, num_draft: int, num_accepted: int, depth: int | None = None) -> None:
        """depth: a tree's depth (the draft positions it covers); a chain's is its length."""
        self.rounds += 1
        self.target_calls += 1
        self.drafted += num_draft
        self.accepted += num_accepted
        depth = num_draft if depth is None else depth
        while len(self.proposed_per_position) < depth:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        for i in range(depth):
            self.proposed_per_position[i] += 1
            if i < num_accepted:
                self.accepted_per_position[i] += 1

    @property
    def acceptance_per_position(self) -> list[float]:
        """Share of proposals at each draft position that were accepted."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_per_position, self.proposed_per_position)]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_call(self) -> float:
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall if self.wall > 0 else 0.0

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.new_tokens < 2:
            return None
        return (self.wall - self.ttft) / (self.new_tokens - 1)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            acceptance_per_position=self.acceptance_per_position,
            acceptance_rate=self.acceptance_rate,
            tokens_per_target_call=self.tokens_per_target_call,
            target_calls_per_token=self.target_calls_per_token,
            tokens_per_s=self.tokens_per_s,
            tpot=self.tpot,
        )
        return out
