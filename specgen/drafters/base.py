"""The drafter interface.

A :class:`Drafter` holds what is shared across requests (weights, settings) and
opens one :class:`DraftSession` per request. A session proposes candidates,
observes how many were accepted, and can be rolled back to the committed state.
Everything a session caches must be recoverable from the committed tokens, so
``sync`` after a commit or an aborted round restores it exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch

from specgen.config.options import parse_num_tokens
from specgen.processors import CommittedCounts, ProcessorStack


@dataclass(frozen=True)
class Proposal:
    """Draft candidates for one round.

    tokens: [num_draft] candidate ids, a chain (or tree nodes if ``parents`` is set).
    draft_probs: [num_draft, vocab] float64, the distribution each token was
        sampled from; None when the proposal is deterministic (q one-hot).
    parents: for tree drafts, the parent node index of each token (-1 = root);
        None for a chain.
    confidence: [num_draft] the drafter's own estimate, in [0, 1], that each
        token is accepted -- for a chain, given the tokens before it were (e.g.
        max q of the distribution it was drawn from); for a tree, that its whole
        path is (e.g. EAGLE's cumulative draft probability). A sampling
        drafter computes confidence[i] *before* drawing token i, never from the
        drawn token: the planner may then stop the chain at any i, and the kept
        length stays a stopping time of the drafter's information (exactness
        holds). None: no estimate.
    """

    tokens: list[int]
    draft_probs: torch.Tensor | None = None
    parents: list[int] | None = None
    confidence: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = Proposal([])


@dataclass
class DraftContext:
    """What a session may read of its request.

    committed: the committed tokens and their counts (read-only for drafters).
    stack: the processor stack the drafter samples from (same config as the target's).
    generator: the drafter's own RNG, part of the round's transaction.
    """

    committed: CommittedCounts
    stack: ProcessorStack
    generator: torch.Generator


class DraftSession(ABC):
    """Per-request drafting state.

    stops_online: the session drafts a chain token by token and accepts a ``stopper``
    in :meth:`propose` (the planner's :class:`~specgen.planning.chain.ChainStopper`), asked
    with each token's confidence before it is drawn; the round then passes one and
    does not truncate afterwards. Sessions without it are never handed a stopper.

    shadows: ``propose(1)`` is cheap and a deterministic function of the committed
    tokens, so a planned round that drafts nothing still asks for it, and the planner
    learns the first position's acceptance from every plain step instead of from
    probes (:meth:`~specgen.planning.acceptance.AcceptanceHistory.expect`).
    """

    stops_online = False
    shadows = False

    @abstractmethod
    def propose(self, budget: int) -> Proposal:
        """Up to ``budget`` candidates following the committed tokens (sessions with
        ``stops_online`` also take ``stopper=``, see the class docstring)."""

    def observe(self, num_accepted: int) -> None:
        """Called after every commit; default: resynchronise caches."""
        self.sync()

    def sync(self) -> None:  # noqa: B027 (stateless sessions have nothing to drop)
        """Drop anything not backed by the committed tokens."""

    def mark(self) -> object:
        """An opaque marker of the session's state, taken before a round."""
        return None

    def rollback(self, mark: object) -> None:
        """Return to the state of ``mark`` (the committed tokens are already restored)."""
        self.sync()

    def close(self) -> None:  # noqa: B027 (sessions without a KV handle hold nothing to give back)
        """The request is over: give back what the session holds (a draft model's KV handle)."""

    def observe_features(self, position: int, features: torch.Tensor) -> None:  # noqa: B027 (most drafters read no features)
        """After a commit, drafters with ``feature_layers`` get the target features
        [m, F] of the committed positions ``position - m + 1 .. position``: every
        position the round's target forward processed and kept, ending with the last
        one (normally ``len(committed) - 2``; the newest token is not yet fed)."""


#: What a drafter proposes: a chain (``Proposal.parents`` None) or a tree of candidates.
DraftShape = Literal["chain", "tree"]


@dataclass(frozen=True)
class HFAssistant:
    """Hugging Face ``generate()``'s counterpart of a drafter, for the bench's baselines.

    method: ``hf_assisted`` (assisted generation with ``model``, a transformers model
    sharing the target's tokenizer) or ``hf_prompt_lookup`` (prompt lookup decoding
    with ``max_ngram``).
    """

    method: Literal["hf_assisted", "hf_prompt_lookup"]
    model: torch.nn.Module | None = None
    max_ngram: int = 3


class Drafter(ABC):
    """A proposal source. ``deterministic`` drafters always return draft_probs=None.

    num_tokens: draft tokens per round (γ; a tree drafter's depth), a positive
    int or "auto" (the planner chooses each round, up to ``auto_max_tokens``).
    max_tokens: the most a round may draft. tree_width: nodes per tree level, for
    the planner's cost estimate before drafting (1 for chains).

    What a drafter is and needs is declared on its class, so a config can be
    checked before anything is built: ``shape`` (chain or tree), ``needs_features``
    (it reads target hidden states: ``feature_layers`` is then a list, else None)
    and ``batchable`` (its rows can share :mod:`specgen.batch`'s batched steps; see
    :func:`batch_refusal`). An instance also names its ``draft_model`` (the
    :class:`~specgen.models.target.Target` it drafts with, or None) and its
    ``hf_assistant`` (None: HF has no counterpart).
    """

    name = "drafter"
    deterministic = False
    auto_max_tokens = 8
    tree_width = 1
    shape: DraftShape = "chain"
    needs_features = False
    batchable = True
    #: The tokenizer of an independent draft model, or None when it shares the target's.
    tokenizer = None
    #: Target hidden states the drafter reads (see ``select_features``); None: none.
    feature_layers: list[int] | None = None

    def __init__(self, num_tokens: int | str):
        self.num_tokens: int | str = parse_num_tokens(num_tokens, "drafter.num_tokens")

    @property
    def max_tokens(self) -> int:
        return self.auto_max_tokens if self.num_tokens == "auto" else self.num_tokens

    @property
    def max_nodes(self) -> int:
        """The most candidates one round's proposal holds (a tree's nodes; a chain's max_tokens)."""
        return self.tree_width * self.max_tokens

    @abstractmethod
    def session(self, ctx: DraftContext) -> DraftSession:
        """Open a session for one request."""

    @property
    def extra_memory_bytes(self) -> int:
        """Bytes of weights the drafter adds beyond the target."""
        return 0

    @property
    def draft_model(self):
        """The independent draft model (a :class:`~specgen.models.target.Target`), or None."""
        return None

    @property
    def hf_assistant(self) -> HFAssistant | None:
        """HF ``generate()``'s counterpart of this drafter, or None when it has none."""
        return None


def batch_refusal(drafter: Drafter | type[Drafter] | None, *, compiled: bool = False,
                  backend: str | None = None) -> str | None:
    """Why rows cannot share batched steps, or None when they can: the one rule of :mod:`specgen.batch`.

    drafter: what the rows draft with (a Drafter or its class; None: they do not
    speculate); compiled: the target is compiled; backend: the name of a target
    backend without batched forwards (None: it has them). The reason is a clause
    ending in "not batched yet", for messages.
    """
    if compiled:
        return "compiled targets are not batched yet"
    if backend is not None:
        return f"the {backend} backend is not batched yet"
    if drafter is None or drafter.batchable:
        return None
    if drafter.shape == "tree":
        return f"tree drafters ({drafter.name}) are not batched yet"
    return f"drafters that read target features ({drafter.name}) are not batched yet"


@dataclass
class DrafterRuntime:
    """What drafter factories get besides their config: the loaded target and a loader.

    load: ``load(source_mapping, name=..., dtype=..., vocab_size=...) -> LoadedModel`` on the pipeline's
        device, in its dtype unless ``dtype`` (``drafter.dtype``) names another; ``vocab_size`` (None: the
        model tokenizer's) is how many logits its forwards keep, the target's for a draft model.
    """

    target: object
    load: object
