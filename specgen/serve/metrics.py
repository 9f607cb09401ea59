"""Server counters and their Prometheus text exposition (format 0.0.4, written by hand).

Updated from the event loop and the worker thread, so every change holds a lock.
"""

from __future__ import annotations

import threading
from collections import Counter

from specgen.events import Generation
from specgen.guarantee import Guarantee

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(str(value))}"' for key, value in sorted(labels.items())) + "}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


class Metrics:
    """Totals since the server started.

    requests: by endpoint and outcome ("ok", "cancelled", "invalid" for a 4xx,
    "error" for a 5xx). generations: finished generations by guarantee, with
    their prompt / completion tokens and draft tokens proposed / accepted.
    stopped: generations the worker closed early because the client went away.
    """

    def __init__(self, model: str, guarantee: Guarantee):
        self.model = model
        self.guarantee = str(guarantee)
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, str]] = Counter()
        self._generations: Counter[str] = Counter()
        self._tokens: Counter[str] = Counter()

    def request(self, endpoint: str, outcome: str) -> None:
        with self._lock:
            self._requests[(endpoint, outcome)] += 1

    def generation(self, gen: Generation) -> None:
        with self._lock:
            self._generations[str(gen.guarantee)] += 1
            self._tokens["prompt"] += len(gen.prompt_ids)
            self._tokens["completion"] += len(gen.token_ids)
            self._tokens["drafted"] += gen.stats.drafted
            self._tokens["accepted"] += gen.stats.accepted
            self._tokens["cached"] += gen.stats.prefill_reused
            self._tokens["prefix_hits"] += gen.stats.prefill_reused > 0

    def stopped(self, new_tokens: int) -> None:
        with self._lock:
            self._tokens["stopped_generations"] += 1
            self._tokens["stopped_tokens"] += new_tokens

    def count(self, endpoint: str, outcome: str) -> int:
        with self._lock:
            return self._requests[(endpoint, outcome)]

    def total(self, name: str) -> int:
        """A token total: prompt, cached (prompt tokens a prefix cache gave), prefix_hits (generations that
        started from one), completion, drafted, accepted, stopped_generations or stopped_tokens."""
        with self._lock:
            return self._tokens[name]

    def render(self, pending: int) -> str:
        """The exposition text; ``pending``: requests waiting for the worker."""
        with self._lock:
            requests, generations, tokens = dict(self._requests), dict(self._generations), dict(self._tokens)
        drafted, accepted = tokens.get("drafted", 0), tokens.get("accepted", 0)
        out: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)

        family("specgen_info", "gauge", "The served model and the guarantee of its configured pipeline.",
               [({"model": self.model, "guarantee": self.guarantee}, 1)])
        family("specgen_requests_total", "counter", "Requests by endpoint and outcome.",
               [({"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(requests.items())])
        family("specgen_generations_total", "counter", "Finished generations by the guarantee they ran under.",
               [({"guarantee": g}, n) for g, n in sorted(generations.items())])
        family("specgen_prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
               [({}, tokens.get("prompt", 0))])
        family("specgen_prompt_cached_tokens_total", "counter",
               "Prompt tokens of finished generations taken from the prefix cache, not prefilled.",
               [({}, tokens.get("cached", 0))])
        finished = sum(generations.values())
        family("specgen_prefix_cache_hit_ratio", "gauge",
               "Finished generations that started from a cached prefix / finished generations.",
               [({}, tokens.get("prefix_hits", 0) / finished if finished else 0.0)])
        family("specgen_completion_tokens_total", "counter", "Generated tokens of finished generations.",
               [({}, tokens.get("completion", 0))])
        family("specgen_draft_tokens_total", "counter", "Draft tokens proposed and verified.", [({}, drafted)])
        family("specgen_accepted_tokens_total", "counter", "Draft tokens accepted.", [({}, accepted)])
        family("specgen_acceptance_ratio", "gauge", "Accepted / drafted over all finished generations.",
               [({}, accepted / drafted if drafted else 0.0)])
        family("specgen_stopped_generations_total", "counter",
               "Generations closed early because their client disconnected.",
               [({}, tokens.get("stopped_generations", 0))])
        family("specgen_stopped_tokens_total", "counter", "Tokens those generations had committed.",
               [({}, tokens.get("stopped_tokens", 0))])
        family("specgen_queue_pending", "gauge", "Requests waiting for the worker.", [({}, pending)])
        return "\n".join(out) + "\n"
