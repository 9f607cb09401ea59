"""Running numbers for the side panel, from the engine's Stats.

The panel always renders a :class:`PanelSnapshot`, an immutable copy made in
the worker thread, so the UI thread never reads engine state while it changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from specgen.guarantee import Guarantee
from specgen.stats import Stats

#: Panel labels for the stages in Stats.timings; "state" is the commit/rollback of request state.
#: "grammar" is shown only when a grammar did some work.
TIMING_LABELS = (("draft", "draft"), ("verify", "verify"), ("process", "process"), ("grammar", "grammar"),
                 ("commit", "state"))


@dataclass(frozen=True)
class PanelSnapshot:
    """What the side panel shows for the reply in progress (or the last one).

    tau: new tokens per target call. acceptance[i]: share of drafts at draft
    position i + 1 that were accepted. prefill_reused / prefill_computed: prompt tokens the
    prefix cache gave / the request prefilled. timings: (label, seconds) per stage, empty
    while unknown. finish_reason: None while the reply streams.
    """

    guarantee: Guarantee
    speculative: bool
    new_tokens: int = 0
    rounds: int = 0
    target_calls: int = 0
    tau: float = 0.0
    tokens_per_s: float = 0.0
    acceptance: tuple[float, ...] = ()
    timings: tuple[tuple[str, float], ...] = ()
    finish_reason: str | None = None
    prefill_reused: int = 0
    prefill_computed: int = 0

    @classmethod
    def from_stats(cls, stats: Stats, guarantee: Guarantee, speculative: bool, *,
                   finish_reason: str | None = None) -> PanelSnapshot:
        timings = tuple((label, getattr(stats.timings, name)) for name, label in TIMING_LABELS
                        if name != "grammar" or stats.timings.grammar > 0)
        return cls(guarantee=guarantee, speculative=speculative, new_tokens=stats.new_tokens, rounds=stats.rounds,
                   target_calls=stats.target_calls, tau=stats.tokens_per_target_call,
                   tokens_per_s=stats.tokens_per_s, acceptance=tuple(stats.acceptance_per_position),
                   timings=timings, finish_reason=finish_reason, prefill_reused=stats.prefill_reused,
                   prefill_computed=stats.prefill_computed)


class Tally:
    """One reply's numbers, collected in the worker thread.

    live: the Stats the engine fills as rounds commit (``Pipeline.stream(stats=...)``);
    final: the request's own Stats once the FinishEvent arrives (the same object).
    """

    def __init__(self, guarantee: Guarantee, speculative: bool):
        self.guarantee = guarantee
        self.speculative = speculative
        self.live = Stats()
        self.final: Stats | None = None

    def finish(self, stats: Stats) -> None:
        """The request's own Stats arrived (FinishEvent): use them from now on."""
        self.final = stats

    def snapshot(self, finish_reason: str | None = None) -> PanelSnapshot:
        """An immutable copy of the current numbers for the UI thread."""
        return PanelSnapshot.from_stats(self.final or self.live, self.guarantee, self.speculative,
                                        finish_reason=finish_reason)
