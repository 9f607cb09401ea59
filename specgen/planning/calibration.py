"""A draft session opened on the calibration context, for timing the drafter's proposals
(:mod:`specgen.planning.measure`), through the drafter's and the target's protocols only.

Nothing here enters the engine: the session is warmed as one greedy round would leave it --
a proposal of one token (which prefills a draft model), one target forward over the context
(with the features a learned head reads), the target's argmax committed, the draft told how
much of it was kept, and the features of every context position handed over -- so its next
proposals cost what a running request's do.
"""

from __future__ import annotations

import torch

from specgen.drafters.base import DraftContext, Drafter, DraftSession
from specgen.models.target import Target
from specgen.processors import CommittedCounts, ProcessorStack
from specgen.sampling import ancestor_matrix

#: The draft generator's seed, as a request with seed 0 derives it.
DRAFT_SEED = 0x5DEECE66D


def open_draft(drafter: Drafter, target: Target, stack: ProcessorStack, vocab_size: int,
               context: list[int], max_tokens: int) -> DraftSession:
    """A session of ``drafter`` on ``context`` (at least 2 token ids), warmed by one round (module
    docstring), ready to ``propose`` up to ``max_tokens`` tokens and to ``mark``/``rollback``."""
    device = torch.device(target.device)
    committed = CommittedCounts.start(context, vocab_size, device)
    session = drafter.session(DraftContext(committed, stack, torch.Generator(device=device).manual_seed(DRAFT_SEED)))
    proposal = session.propose(1)
    cache = target.new_cache()
    try:
        if drafter.feature_layers is None:
            row = target.forward(cache, context, keep=1)  # [1, vocab]
            features = None
        else:  # the context as a chain, no nodes: row 0 is its last token's
            out = target.forward_tree(cache, context, [], ancestor_matrix([]), [], drafter.feature_layers)
            row = out.logits(0)  # [1, vocab]
            features = torch.cat([out.chain_features, out.features[:1]])  # [len(context), F]
    finally:
        cache.release()
    token = int(row[0].argmax())
    num_accepted = int(len(proposal) > 0 and proposal.tokens[0] == token)
    committed.commit([token])
    session.observe(num_accepted)
    if features is not None:
        session.observe_features(len(context) - 1, features)
    return session
