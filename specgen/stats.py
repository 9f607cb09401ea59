"""Per-request metrics of a generation: acceptance, calls and a time split."""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class Lap:
    """The seconds one :meth:`Clock.stage` block charged to its stage (set when the block ends)."""

    seconds: float = 0.0


class Clock:
    """perf_counter that first synchronises ``device`` when it is a CUDA device,
    so GPU work is timed where it runs (on that device, not the default one).

    ``with clock.stage("verify"):`` charges the time inside to a stage; a stage
    opened inside another pauses the outer one (the tree path's lazy LM head runs
    during processing but is verify work). :meth:`carve` moves seconds measured
    inside the open stage to another one without opening a stage (the grammar's
    cheap per-call timing, see :class:`GrammarTimer`). :meth:`take_laps` returns
    and clears the seconds charged per stage since the last call.
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

    def stage(self, name: str) -> _Stage:
        """Charge the time inside to ``name``; the :class:`Lap` the block enters with holds, once
        the block ends, the seconds this block charged to ``name`` (a nested stage's excluded)."""
        return _Stage(self, name)

    def carve(self, name: str, seconds: float) -> None:
        """Charge ``seconds`` to ``name`` instead of the open stage (if any).

        The seconds must have just passed inside the open stage's current stretch
        (since it was entered or resumed after a nested stage), so the open stage
        loses exactly what ``name`` gains and the laps still sum to the wall time.
        """
        self._charge(name, seconds)
        if self._open is not None:
            self._open = (self._open[0], self._open[1] + seconds)

    def take_laps(self) -> dict[str, float]:
        laps, self._laps = self._laps, {}
        return laps


class _Stage:
    """One ``with clock.stage(name)`` block (a plain class: it runs several times a token)."""

    __slots__ = ("clock", "name", "outer", "before", "lap")

    def __init__(self, clock: Clock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self) -> Lap:
        clock = self.clock
        self.outer = outer = clock._open
        now = clock()
        if outer is not None:
            clock._charge(outer[0], now - outer[1])
        clock._open = (self.name, now)
        self.before = clock._laps.get(self.name, 0.0)
        self.lap = Lap()
        return self.lap

    def __exit__(self, *exc) -> None:
        clock, name, outer = self.clock, self.name, self.outer
        now = clock()
        clock._charge(name, now - clock._open[1])
        clock._open = None if outer is None else (outer[0], now)
        self.lap.seconds = clock._laps[name] - self.before


class GrammarTimer:
    """A request's meter for grammar work, handed to its grammar when the request is
    opened (:meth:`specgen.processors.ProcessorStack.with_timer`).

    Grammar work is charged to the clock's ``"grammar"`` stage out of whichever stage
    it runs inside (process on the target side, draft on the drafter side) via
    :meth:`Clock.carve`; ``samples`` gets one entry per masked position (seconds,
    a row of a processor call or a node of a drafted tree level). Readings come from
    the clock's own timer: a perf_counter pair per position, no allocation beyond the
    sample itself. Work that queues device work (masking logits) brackets itself with
    ``sync=True`` readings, which on a CUDA clock first wait for the device, so work
    queued before it stays with the outer stage and its own stays with the grammar;
    host-only work (walking states) reads without a sync.
    """

    STAGE = "grammar"

    def __init__(self, clock: Clock, samples: array):
        self.clock = clock
        self.samples = samples  # array("d"): seconds per masked position

    def now(self, sync: bool = False) -> float:
        """A reading to start a stretch of grammar work with (``sync``: see the class docstring)."""
        return self.clock() if sync else self.clock.timer()

    def position(self, since: float) -> float:
        """Record one position's mask seconds (now - ``since``, a :meth:`now` reading); -> now."""
        now = self.clock.timer()
        self.samples.append(now - since)
        return now

    def spent(self, start: float, last: float | None = None, positions: int = 0, sync: bool = False) -> None:
        """The grammar worked from ``start`` (a :meth:`now` reading) until now: charge that to the
        stage. The time since ``last`` (work shared by the ``positions`` samples recorded last,
        e.g. applying their masks) is spread evenly over them, so a call's samples sum to its time."""
        now = self.clock() if sync else self.clock.timer()
        if positions:
            share = (now - last) / positions
            for i in range(len(self.samples) - positions, len(self.samples)):
                self.samples[i] += share
        self.clock.carve(self.STAGE, now - start)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q``-quantile (0 < q <= 1) of ``values``; None when empty."""
    if not len(values):
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


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
    """Seconds spent in each stage of the rounds. grammar: mask work of a grammar, on the
    target side (out of process) and the drafter side (out of draft); 0 without one."""

    draft: float = 0.0
    verify: float = 0.0
    process: float = 0.0
    grammar: float = 0.0
    commit: float = 0.0


@dataclass
class Stats:
    """rounds: speculative rounds (or plain steps). target_calls: target forwards.
    drafted / accepted: draft tokens proposed / kept. proposed_per_position[i] and
    accepted_per_position[i]: the same for draft position i + 1. planned_rounds,
    planned_drafts, planned_plain: rounds whose γ the planner chose, their draft
    tokens, and how many of them verified none (a plain step). draft_size_counts[n]:
    speculative rounds that verified n draft tokens (tree nodes) -- the verify
    pass's size minus one. mask_seconds: under a grammar, the seconds of each masked
    position, target and drafter sides (see :class:`GrammarTimer`; :meth:`to_dict`
    gives its count and percentiles instead). prefill_reused / prefill_computed: prompt tokens
    whose KV a prefix cache gave the request / that it fed (their sum is ``prompt_tokens``).
    """

    rounds: int = 0
    target_calls: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    prefill_reused: int = 0
    prefill_computed: int = 0
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
    mask_seconds: array = field(default_factory=lambda: array("d"))

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
    def grammar_share(self) -> float | None:
        """Share of wall time spent in grammar work; None without a grammar (nothing masked)."""
        if not self.mask_seconds and not self.timings.grammar:
            return None
        return self.timings.grammar / self.wall if self.wall > 0 else 0.0

    def mask_percentile(self, q: float) -> float | None:
        """Seconds per masked position at quantile ``q`` (e.g. 0.5, 0.99); None when nothing was masked."""
        return percentile(self.mask_seconds, q)

    @property
    def grammar_summary(self) -> str | None:
        """e.g. "grammar 1.2% of wall, mask p50 45 µs p99 3.1 ms"; None without a grammar."""
        share = self.grammar_share
        if share is None:
            return None
        text = f"grammar {100 * share:.1f}% of wall"
        if self.mask_seconds:
            text += f", mask p50 {_duration(self.mask_percentile(0.5))} p99 {_duration(self.mask_percentile(0.99))}"
        return text

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.new_tokens < 2:
            return None
        return (self.wall - self.ttft) / (self.new_tokens - 1)

    def to_dict(self) -> dict:
        """A JSON-ready dict: the fields (``mask_seconds`` as its count and p50/p99) and the derived figures."""
        out = asdict(self)
        del out["mask_seconds"]
        out.update(
            mask_positions=len(self.mask_seconds),
            mask_p50_s=self.mask_percentile(0.5),
            mask_p99_s=self.mask_percentile(0.99),
            grammar_share=self.grammar_share,
            acceptance_per_position=self.acceptance_per_position,
            acceptance_rate=self.acceptance_rate,
            tokens_per_target_call=self.tokens_per_target_call,
            target_calls_per_token=self.target_calls_per_token,
            tokens_per_s=self.tokens_per_s,
            tpot=self.tpot,
            planner_summary=self.planner_summary,
        )
        return out


def _duration(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if seconds >= 1e-3 else f"{1e6 * seconds:.0f} µs"
