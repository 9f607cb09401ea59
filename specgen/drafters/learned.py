"""What the learned drafters (EAGLE, MTP, Medusa) share: the head file, the
target feature they start from, and mapping draft-vocabulary logits to ids.

A learned session drafts from the target feature of the last token the target
has processed (position ``len(committed) - 2``; the newest committed token has
not been fed yet) and the newest token itself. The round hands the feature over
after every commit; it is part of the session's mark, so a rolled-back round
restores it. Without a current feature (the first round, or after a stop string
cut the committed tokens) a session proposes nothing and the round's target
forward supplies one. Under a grammar, a session's ``grammar`` (see
:mod:`specgen.drafters.tree_grammar`) masks the draft distribution of every node.
"""

from __future__ import annotations

import pathlib

import torch

from specgen.drafters.base import DraftContext, Drafter, DraftSession
from specgen.drafters.tree_grammar import tree_grammar
from specgen.errors import ConfigError
from specgen.heads import DraftHead, load_head
from specgen.models import resolve_drafter_dtype
from specgen.models.target import hf_model_of

TRAINED_DIR = pathlib.Path(__file__).resolve().parent.parent / "heads" / "trained"


def resolve_head_file(head_file: str) -> pathlib.Path:
    """``builtin:<target>/<kind>`` names a head shipped in specgen/heads/trained; anything else is a path."""
    if head_file.startswith("builtin:"):
        return TRAINED_DIR / f"{head_file[len('builtin:'):]}.safetensors"
    return pathlib.Path(head_file).expanduser()


class LearnedSession(DraftSession):
    def __init__(self, drafter: LearnedDrafter, ctx: DraftContext):
        self.drafter = drafter
        self.head = drafter.head
        self.ctx = ctx
        self.position = -1
        self.feature: torch.Tensor | None = None  # [F]
        self.grammar = tree_grammar(ctx, self.head.vocab_ids)  # None without a grammar in the stack

    def observe_features(self, position: int, features: torch.Tensor) -> None:
        self.position, self.feature = position, features[-1]

    def mark(self) -> tuple[int, torch.Tensor | None]:
        return self.position, self.feature

    def rollback(self, mark: tuple[int, torch.Tensor | None]) -> None:
        self.position, self.feature = mark

    def root(self, budget: int) -> tuple[torch.Tensor, int] | None:
        """(feature [1, F], newest committed token), or None without a current feature or budget."""
        tokens = self.ctx.committed.tokens
        if budget <= 0 or self.feature is None or self.position != len(tokens) - 2:
            return None
        return self.feature.unsqueeze(0).to(self.head.vocab_ids.device), tokens[-1]

    def to_ids(self, draft_indices: torch.Tensor) -> list[int]:
        """Draft-vocabulary indices -> target token ids."""
        return self.head.vocab_ids[draft_indices].tolist()

    def full_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[N, Vd] -> [N, vocab] with -inf outside the draft vocabulary (q is zero there)."""
        full = torch.full((draft_logits.shape[0], self.drafter.vocab_size), float("-inf"),
                          dtype=torch.float32, device=draft_logits.device)
        full[:, self.head.vocab_ids] = draft_logits.float()
        return full


class LearnedDrafter(Drafter):
    """A drafter backed by a trained head for this exact target: every head reads target
    features (``feature_layers``, [] = the last hidden state), so none is batched."""

    needs_features = True
    batchable = False
    session_class: type[LearnedSession] = LearnedSession

    def __init__(self, head: DraftHead, vocab_size: int, num_tokens: int, head_file: pathlib.Path | None = None):
        super().__init__(num_tokens)
        self.head = head
        self.vocab_size = int(vocab_size)
        self.head_file = head_file
        self.feature_layers = list(head.cfg.feature_layers)

    def session(self, ctx: DraftContext) -> DraftSession:
        return self.session_class(self, ctx)

    @property
    def extra_memory_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.head.parameters())


def load_for_target(runtime, head_file: str, kind: str | tuple[str, ...], dtype=None) -> tuple[DraftHead, pathlib.Path, int]:
    """Load a head of ``kind`` (or one of several kinds; the first names the drafter) at
    ``head_file`` for the runtime's target, in ``dtype`` (``drafter.dtype``, see
    :func:`specgen.models.resolve_drafter_dtype`); refuse a mismatch."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    kind = kinds[0]
    if not head_file:
        raise ConfigError(f"drafter={kind} needs drafter.head_file=<a .safetensors head from specgen-train>")
    path = resolve_head_file(str(head_file))
    lm = runtime.target.lm
    model = hf_model_of(lm)  # a head reads the target's embeddings and fingerprint
    if model is None or not lm.capabilities.features:
        raise ConfigError(f"drafter={kind} needs the target's hidden states, which the {lm.backend} backend "
                          "does not serve; use backend=torch")
    head_dtype = resolve_drafter_dtype(dtype, lm.dtype, lm.device)
    head, _ = load_head(path, model, kind=kinds, dtype=head_dtype)
    return head, path, lm.vocab_size
