"""The pipeline: one generation loop that yields events.

``Pipeline.stream`` is the only loop. It runs speculative rounds when the
pipeline's guarantee allows it, else plain steps, and yields a
:class:`~specgen.events.TokenEvent` per committed token followed by one
:class:`~specgen.events.FinishEvent`. Closing the iterator early (Ctrl-C, a
cancel button) ends the request: a round that was interrupted is rolled back,
never half-committed, and the pipeline stays ready for the next request.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from specgen.drafters import DraftContext, Drafter
from specgen.errors import ConfigError, DeadEndError, PromptError
from specgen.events import FinishEvent, Generation, TokenEvent
from specgen.guarantee import Guarantee
from specgen.models import TokenizerInfo
from specgen.models.prefix_cache import PrefixCache, common_prefix
from specgen.models.target import Target, TokenCache
from specgen.config.options import (RequestOptions, check_prompt, check_prompt_ids, check_prompt_size, parse_chat,
                                    parse_int, parse_optional_text, request_options, with_overrides)
from specgen.config.run import PrefixCacheSettings, RequestDefaults, RunConfig
from specgen.planning import AUTO, CostTable, calibration
from specgen.planning.measure import Subject
from specgen.planning.observed import ObservedCosts
from specgen.planning.planner import Planner
from specgen.processors import ProcessorStack
from specgen.engine.request import RequestPlan, finish, record
from specgen.engine.round import RoundContext, plain_step, speculative_round
from specgen.sampling.logprobs import MAX_TOP_LOGPROBS, TokenLogprob, token_logprobs
from specgen.engine.state import Request
from specgen.stats import Clock, GrammarTimer, Stats
from specgen.text import TextStream


@dataclass(frozen=True)
class Scores:
    """A scored text (:meth:`Pipeline.score`): its token ids and their logprobs (the first None)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Pipeline:
    """A composed target + drafter + processor stack with a declared guarantee.

    guarantee: what the build decided (:class:`~specgen.guarantee.Guarantee`);
    speculation runs only when its kind is not "off".
    read_once: rounds that spend FLOPs to read back once per verification (constant
    host reads per round), the default off the CPU; on the CPU, where a read costs
    nothing, rounds do less arithmetic instead (see :class:`specgen.engine.round.RoundContext`).
    observed: the verify timings its requests' rounds record and plan through (each request's
    :class:`~specgen.planning.planner.Planner`) once the cost table is loaded
    (:mod:`specgen.planning.observed`; None: plans read the table alone).
    prefix_cache: finished requests' target KV handles, which later requests start from
    (:mod:`specgen.models.prefix_cache`; sized by the config's ``prefix_cache`` group, off where
    the target does not declare ``prefix_reuse``).
    config: the run's :class:`~specgen.config.run.RunConfig` (checked once, by the entry point);
    defaults: its request defaults (:class:`~specgen.config.run.RequestDefaults`).
    """

    def __init__(self, *, target: Target, tokenizer: TokenizerInfo, drafter: Drafter | None,
                 stack: ProcessorStack, guarantee: Guarantee, config: RunConfig):
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.stack = stack
        self.guarantee = guarantee
        self.defaults: RequestDefaults = config.requests
        self.config = config
        self.device = target.device
        self.costs: CostTable | None = None
        self.read_once = torch.device(self.device).type != "cpu"
        self.observed: ObservedCosts | None = None
        self._costs_lock = threading.RLock()
        self.prefix_cache = prefix_cache_for(target, config.prefix_cache)

    def cost_table(self, *, refresh: bool = False) -> CostTable:
        """The planner's cost table for this pipeline (measured once, cached on disk; see specgen.planning.cost_cache)."""
        with self._costs_lock:  # requests on other threads wait for one measurement
            if self.costs is None or refresh:
                from specgen.planning.cost_cache import cost_table, observer

                self.costs = cost_table(self.cost_subject(), refresh=refresh)
                if self.observed is None or refresh:
                    self.observed = observer(self.config.observe_costs)
            return self.costs

    def cost_subject(self) -> Subject:
        """What this pipeline's cost tables are measured on: its target, and a draft session opened
        on the calibration context through the drafter's and the target's protocols
        (:func:`specgen.planning.calibration.open_draft`)."""
        drafter = self.drafter
        open_draft = None
        if drafter is not None:
            open_draft = functools.partial(calibration.open_draft, drafter, self.target, self.stack,
                                           self.tokenizer.vocab_size)
        return Subject(self.target, self.tokenizer.vocab_size, self.config.checked,
                       trees=drafter is not None and (drafter.tree_width > 1 or drafter.feature_layers is not None),
                       feature_layers=None if drafter is None else drafter.feature_layers,
                       open_draft=open_draft, draft_model=None if drafter is None else drafter.draft_model)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.guarantee.speculative

    def encode(self, prompt, *, chat=None, system=None) -> list[int]:
        """Token ids for a prompt string or chat messages (checked; PromptError names what is wrong)."""
        prompt = check_prompt(prompt)
        check_prompt_size(prompt, self.target.context_length)
        chat = parse_chat(self.defaults.chat if chat is None else chat)
        return self.tokenizer.encode_prompt(prompt, chat=chat, system=self._system(system))

    def prepare(self, prompt, *, chat=None, system=None) -> None:
        """Start feeding, in the background, what a request still being written will begin with, so
        that when it comes it prefills only the rest: ``prompt`` (chat messages whose last is the
        user's, or a text) as :meth:`encode` renders it, up to the last complete word of its last
        message (:meth:`TokenizerInfo.typed_prefix_ids`), into the prefix cache
        (:meth:`PrefixCache.prepare`). Returns at once; nothing happens where the prefix cache is off
        or those ids would not fit the context. A request served from prepared entries gets a fresh
        prefill's logits wherever the target declares ``prefix_reuse``. Bad input raises as
        :meth:`encode` does."""
        if not self.prefix_cache.enabled:
            return
        prompt = check_prompt(prompt)
        chat = parse_chat(self.defaults.chat if chat is None else chat)
        ids = self.tokenizer.typed_prefix_ids(prompt, chat=chat, system=self._system(system))
        if len(ids) < self.target.context_length:
            self.prefix_cache.prepare(ids)

    def _system(self, system) -> str | None:
        """A request's system message: its own, else the pipeline's default (checked)."""
        return parse_optional_text(self.defaults.system if system is None else system, "system")

    def generate(self, prompt: str | Sequence[dict] | None = None, options: RequestOptions | None = None, *,
                 prompt_ids: Sequence[int] | None = None, **overrides) -> Generation:
        """Run :meth:`stream` to the end and return its :class:`Generation` (arguments as :meth:`stream`'s)."""
        plan = self.plan_request(prompt, prompt_ids, self.resolve(options, overrides, "generate()"))
        for event in self.run_plan(plan):
            if isinstance(event, FinishEvent):
                return event.generation
        raise RuntimeError("stream ended without a finish event")

    def generate_batch(self, prompts: Sequence, *, batch_size: int = 8, options: RequestOptions | None = None,
                       **overrides) -> list[Generation]:
        """Generate every prompt with continuous batching (see :mod:`specgen.batch`); -> Generations in input order.

        prompts: each a str, chat messages, or a dict of per-row options (prompt or
        prompt_ids, max_new_tokens, seed, stop, schema, regex, speculative, ...);
        options / overrides: shared by every row, as :meth:`stream` takes them.
        Each row's output law equals :meth:`generate`'s.
        """
        from specgen.batch import generate_batch

        return generate_batch(self, prompts, batch_size=batch_size, options=options, **overrides)

    def stream(self, prompt: str | Sequence[dict] | None = None, options: RequestOptions | None = None, *,
               prompt_ids: Sequence[int] | None = None, **overrides) -> Iterator[TokenEvent | FinishEvent]:
        """Generate from ``prompt`` (text or chat messages) or ``prompt_ids``.

        options: a :class:`~specgen.config.options.RequestOptions` (None: the pipeline's
        defaults); overrides: RequestOptions fields by name, set over ``options``
        (``stream(p, max_new_tokens=8)``; an override of None changes nothing). An
        unknown name raises ConfigError naming it (and the closest known one).
        Every value is checked by :func:`specgen.config.options.request_options` before
        the first event: a bad one raises a SpecgenError subclass that names it
        (nothing is truncated or coerced). stop: one string is one stop string.
        speculative / chat: bools or the usual spellings ("no", "off", ...);
        False forces plain decoding for this call, True or None uses the
        pipeline's setting. schema / regex: constrain this call's output (a JSON
        schema as dict, JSON string, file path or pydantic model class; a regex);
        the grammar mask joins the processor stack of both p and q. stats: a
        fresh Stats for the engine to fill as rounds commit (live numbers for a
        UI, readable between events); the FinishEvent's generation carries the
        same object; a Stats that already holds numbers is refused. num_tokens:
        draft tokens per round (γ) for this call instead of the drafter's setting.
        """
        return self.run_plan(self.plan_request(prompt, prompt_ids, self.resolve(options, overrides, "stream()")))

    def resolve(self, options: RequestOptions | None, overrides: dict, where: str) -> RequestOptions:
        """``options`` with ``overrides`` (RequestOptions field names), checked and with this
        pipeline's defaults filled in; ConfigError names an unknown override and ``where``."""
        return request_options(self.defaults, with_overrides(options, overrides, where))

    def run_plan(self, plan: RequestPlan) -> Iterator[TokenEvent | FinishEvent]:
        """The events of one checked request (:meth:`plan_request`), as :meth:`stream` yields them."""
        return self._run(plan)

    def plan_request(self, prompt, prompt_ids, options: RequestOptions) -> RequestPlan:
        """Encode and check one request's prompt against the context, and derive what runs it
        (shared by :meth:`stream` and :func:`specgen.batch.generate_batch`)."""
        ids = self._prompt_ids(prompt, prompt_ids, options.chat, options.system)
        max_new = options.max_new_tokens
        room = self.target.context_length - len(ids)
        if room < 1:
            more = f" or {self.target.context_hint}" if self.target.context_hint else ""
            raise PromptError(f"the prompt has {len(ids)} tokens but the model's context is "
                              f"{self.target.context_length}; shorten the prompt{more}")
        use_spec = self.speculative and options.speculative
        guarantee = self.guarantee if use_spec or not self.speculative else Guarantee.off("speculative=false")
        gamma = 0
        if use_spec:
            gamma = self.drafter.num_tokens if options.num_tokens is None else options.num_tokens
        return RequestPlan(ids, min(max_new, room), max_new > room, options, use_spec, guarantee,
                           self._stack_for(options.schema, options.regex), gamma,
                           self._next_turn(prompt, ids, options))

    def _next_turn(self, prompt, ids: list[int], options: RequestOptions) -> Callable[[str], list[int]] | None:
        """For chat messages rendered with the template, while the prefix cache anticipates: the
        reply's text -> the ids the next turn's prompt starts with (the conversation with that reply
        and a user header, :meth:`TokenizerInfo.next_turn_ids`), or [] where they do not start
        with this prompt's ``ids`` or leave no room in the context. None for other prompts."""
        if (isinstance(prompt, str) or prompt is None or not self.prefix_cache.enabled
                or not self.config.prefix_cache.anticipate):
            return None
        messages, system, limit = list(prompt), self._system(options.system), self.target.context_length

        def next_turn(reply: str) -> list[int]:
            expected = self.tokenizer.next_turn_ids(messages, reply, system=system)
            return expected if expected[:len(ids)] == ids and len(ids) < len(expected) < limit else []

        return next_turn

    def _stack_for(self, schema, regex) -> ProcessorStack:
        if schema is None and regex is None:
            return self.stack
        if schema is not None and regex is not None:
            raise ConfigError("give schema= or regex=, not both")
        from specgen.grammar import grammar_processor

        spec = {"kind": "json_schema", "schema": schema} if schema is not None else {"kind": "regex", "pattern": regex}
        return self.stack.with_grammar(grammar_processor(spec, self.tokenizer))

    def _prompt_ids(self, prompt, prompt_ids, chat, system) -> list[int]:
        if (prompt is None) == (prompt_ids is None):
            raise PromptError("give exactly one of prompt or prompt_ids")
        if prompt_ids is not None:
            ids = check_prompt_ids(prompt_ids, self.tokenizer.vocab_size)
        else:
            ids = self.encode(prompt, chat=chat, system=system)
        if not ids:
            raise PromptError("the prompt is empty")
        return ids

    def open_request(self, ids: list[int], *, max_new_tokens: int, seed: int | None = None,
                     stop: Sequence[str] | None = None, use_spec: bool = True,
                     stack: ProcessorStack | None = None, stats: Stats | None = None,
                     target_cache: TokenCache | None = None) -> tuple[Request, RoundContext]:
        """Fresh request state and round context (the engine loop's setup; tests drive rounds with it).
        seed / stop: checked values (:func:`~specgen.config.options.request_options` parses them; None:
        the pipeline's defaults, checked with the run config). target_cache: the request's KV handle
        (None: a new one of the target's); the ids it already holds of ``ids`` count as ``stats.prefill_reused``.

        The round context and the draft session share one stack: ``stack`` (default the
        pipeline's) with its grammar metered by this request's clock and stats
        (:meth:`~specgen.processors.ProcessorStack.with_timer`)."""
        seed = self.defaults.seed if seed is None else seed
        stop = self.defaults.stop if stop is None else stop
        stack = self.stack if stack is None else stack
        cache = self.target.new_cache() if target_cache is None else target_cache
        request = Request(prompt_ids=ids, vocab_size=self.tokenizer.vocab_size, device=self.device,
                          target_cache=cache, text=TextStream(self.tokenizer.decode, stop),
                          eos_ids=self.tokenizer.eos_ids, max_new_tokens=max_new_tokens, seed=seed)
        stats = Stats() if stats is None else stats
        stats.prompt_tokens = len(ids)
        stats.prefill_reused = min(common_prefix(cache.tokens, ids), len(ids) - 1)  # what the first forward skips
        stats.prefill_computed = len(ids) - stats.prefill_reused
        clock = Clock(self.device)
        stack = stack.with_timer(GrammarTimer(clock, stats.mask_seconds))
        drafter = self.drafter if use_spec and self.speculative else None
        ctx = RoundContext(self.target, stack, stats, clock, read_once=self.read_once,
                           feature_layers=None if drafter is None else drafter.feature_layers)
        limits = {} if drafter is None else {"max_tokens": drafter.max_tokens, "tree_width": drafter.tree_width,
                                             "load_costs": self.cost_table}
        request.planner = Planner(observed=self.observed, read_once=self.read_once, **limits)
        if drafter is not None:
            request.draft = self.drafter.session(DraftContext(request.committed, stack, request.draft_rng))
            stats.drafter_memory_bytes = self.drafter.extra_memory_bytes
        return request, ctx

    def open_plan(self, plan: RequestPlan, target_cache: TokenCache | None = None) -> tuple[Request, RoundContext]:
        """:meth:`open_request` for a checked request (shared by the engine loop and batch rows): with
        its logprobs asked for, its prompt scored (echo), and ended at once when it may add no token."""
        options = plan.options
        request, ctx = self.open_request(plan.ids, max_new_tokens=plan.max_new, seed=options.seed, stop=options.stop,
                                         use_spec=plan.use_spec, stack=plan.stack, stats=options.stats,
                                         target_cache=target_cache)
        ctx = replace(ctx, logprobs=options.logprobs, raw_logprobs=options.logprobs_of == "raw")
        if options.echo:
            request.prompt_logprobs = self.score_ids(plan.ids, options.logprobs or 0)
        if plan.max_new == 0:  # echo with max_new_tokens=0: scored, nothing generated
            request.finish_reason = "length"
        return request, ctx

    def score(self, prompt: str | Sequence[dict] | None = None, *, prompt_ids: Sequence[int] | None = None,
              top_logprobs: int = 0, chat: bool | str = False) -> Scores:
        """Score a text (or chat messages, or token ids) under the target by teacher forcing.

        -> :class:`Scores`: the token ids and one logprob per token (the first None, nothing
        predicts it), each with its ``top_logprobs`` (0..20) most likely alternatives. The law:
        the log-softmax (float64) of the target's raw logits of one prefill over the whole text;
        no processor, temperature or grammar applies. chat: False scores the text as it is."""
        ids = self._prompt_ids(prompt, prompt_ids, chat, None)
        top = parse_int(top_logprobs, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
        return Scores(ids, self.score_ids(ids, top))

    def score_ids(self, ids: list[int], top: int) -> list[TokenLogprob | None]:
        """The teacher-forced logprobs of checked prompt ``ids`` (:meth:`score`'s law): one forward
        on a KV handle of its own, released after."""
        if len(ids) > self.target.context_length:
            raise PromptError(f"the text has {len(ids)} tokens but the model's context is "
                              f"{self.target.context_length}; shorten it")
        cache = self.target.new_cache()
        try:
            raw = self.target.forward(cache, ids, keep=len(ids))  # [len(ids), vocab]: row i predicts token i + 1
        finally:
            cache.release()
        return [None, *token_logprobs(raw, ids[1:], top)]

    def _run(self, plan: RequestPlan) -> Iterator[TokenEvent | FinishEvent]:
        start = time.perf_counter()  # the prefix cache's handle (maybe waited for) counts in the request's time
        request, ctx = self.open_plan(plan, target_cache=self.prefix_cache.acquire(plan.ids)[0])
        done = None
        if request.draft is not None and plan.gamma == AUTO:
            load = time.perf_counter()
            request.planner.attach(self.cost_table(), self.observed)  # measured once per machine and cached; not part of this request's time
            start += time.perf_counter() - load
        try:
            while request.finish_reason is None:
                try:
                    if request.draft is not None:
                        events = speculative_round(request, ctx, plan.gamma)
                    else:
                        events = plain_step(request, ctx)
                except DeadEndError:
                    request.finish_reason = "dead_end"
                    break
                record(ctx.stats, events, start)
                yield from events
            done = finish(request, plan, ctx.stats, start)
        finally:  # also when the stream is closed early or a round fails: then the handle is released
            request.release(keep_target=done is not None)
            if done is not None:
                handle = request.target_cache
                ahead = None if plan.next_turn is None else functools.partial(plan.next_turn, done.generation.text)
                self.prefix_cache.park(handle, unfed(handle.tokens, request.committed.tokens), ahead)
        yield done


def unfed(entries: list[int], committed: list[int]) -> list[int]:
    """The committed ids past a handle's ``entries`` (a finished request's last sampled token, which
    no forward fed); none where the entries are not a prefix of them."""
    return list(committed[len(entries):]) if list(committed[:len(entries)]) == list(entries) else []


def prefix_cache_for(target: Target, settings: PrefixCacheSettings) -> PrefixCache:
    """The prefix cache a pipeline on ``target`` keeps: the run config's ``prefix_cache`` section,
    off when the target does not declare ``prefix_reuse``. Parked handles are settled by a prefill
    of what the next request is expected to start with and, where the target reuses only entries
    of prefills (``prefill_floor`` above 1), of the rest (see :mod:`specgen.models.prefix_cache`)."""
    capabilities = target.capabilities
    entries = settings.entries if capabilities.prefix_reuse else 0

    def settle(handle: TokenCache, ids: list[int]) -> None:
        target.forward(handle, ids, keep=1)

    return PrefixCache(target.new_cache, entries=entries, max_bytes=settings.bytes,
                       floor=capabilities.prefill_floor, settle=settle)
