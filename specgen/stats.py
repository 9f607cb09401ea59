"""Per-request metrics of a generation: acceptance, calls and a time split."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch


class Clock:
    """perf_counter that first synchronises ``device`` when it is a CUDA device,
    so GPU work is timed where it runs (on that device, not the default one).

    ``with clock.stage("verify"):`` charges the time inside to a stage; a stage
    opened inside another pauses the outer one (the tree path's lazy LM head runs
    during processing but is verify work). :meth:`take_laps` returns and clears
    the seconds charged per stage since the last call.
    """

    def __init__(self, device: torch.device, timer=time.perf_counter):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.timer = timer
        self._laps: dict[str, float] = {}
        self._open: tuple[str, float] | None = None

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return self.timer()

    def _charge(self, name: str, seconds: float) -> None:
        self._laps[name] = self._laps.get(name, 0.0) + seconds

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        outer = self._open
        now = self()
        if outer is not None:
            self._charge(outer[0], now - outer[1])
        self._open = (name, now)
        try:
            yield
        finally:
            now = self()
            self._charge(name, now - self._open[1])
            self._open = None if outer is None else (outer[0], now)

    def take_laps(self) -> dict[str, float]:
        laps, self._laps = self._laps, {}
        return laps


@dataclass(frozen=True)
class RoundResult:
    """What one round (or plain step) did, for :meth:`Stats.record`.

    num_drafted: draft tokens verified (tree nodes for a tree); num_accepted:
    those kept; depth: draft positions covered (a chain's length, a tree's depth);
    planned: True when the planner chose num_drafted (num_tokens=auto);
    speculative: False for a plain step; timings: seconds per stage.
    """

    num_drafted: int = 0
    num_accepted: int = 0
    depth: int = 0
    planned: bool = False
    speculative: bool = True
    timings: dict[str, float] = field(default_factory=dict)


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
    accepted_per_position[i]: the same for draft position i + 1. planned_rounds,
    planned_drafts, planned_plain: rounds whose γ the planner chose, their draft
    tokens, and how many of them verified none (a plain step). draft_size_counts[n]:
    speculative rounds that verified n draft tokens (tree nodes) -- the verify
    pass's size minus one.
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
    draft_size_counts: list[int] = field(default_factory=list)
    planned_rounds: int = 0
    planned_drafts: int = 0
    planned_plain: int = 0

    def record(self, result: RoundResult) -> None:
        """Add one round's counts and stage times."""
        for name, seconds in result.timings.items():
            setattr(self.timings, name, getattr(self.timings, name) + seconds)
        if not result.speculative:
            self.rounds += 1
            self.target_calls += 1
            return
        self.record_round(result.num_drafted, result.num_accepted, result.depth)
        if result.planned:
            self.planned_rounds += 1
            self.planned_drafts += result.num_drafted
            self.planned_plain += result.num_drafted == 0

    @property
    def planner_summary(self) -> str | None:
        """e.g. "γ auto: mean 1.7, plain steps 12%"; None when no round was planned."""
        if not self.planned_rounds:
            return None
        mean = self.planned_drafts / self.planned_rounds
        return f"γ auto: mean {mean:.1f}, plain steps {100 * self.planned_plain / self.planned_rounds:.0f}%"

    def record_round(self, num_draft: int, num_accepted: int, depth: int | None = None) -> None:
        """depth: a tree's depth (the draft positions it covers); a chain's is its length."""
        self.rounds += 1
        self.target_calls += 1
        self.drafted += num_draft
        self.accepted += num_accepted
        while len(self.draft_size_counts) <= num_draft:
            self.draft_size_counts.append(0)
        self.draft_size_counts[num_draft] += 1
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
            planner_summary=self.planner_summary,
        )
        return out
