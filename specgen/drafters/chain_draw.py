"""Drawing a draft chain token by token from the processor stack, recording q.

The one draw-and-record helper of the drafters that sample step by step (the
small model, MTP, DSpark). Step ``i``'s distribution q_i is the stack applied to the
drafter's raw logits with the drafter's own history (committed tokens + its
draws before ``i``); the recorded rows are exactly what was sampled from, so
verification is exact. Each step uses one uniform from the drafter's generator,
in order, on both paths below, so they draw the same tokens:

* **device-resident** (no processor in use reads token ids, see
  ``Processor.host_tokens``): each token stays on the device and is fed straight
  back; :meth:`ChainDraws.finish` reads every token, check and confidence back
  in one transfer, whatever the chain's length;
* **host** (a grammar, bad words, an HF processor): each token is read back at
  its step, as those processors need the ids.

Stopping rules: the chain ends before the first step whose row allows nothing
(the draft's own dead end, e.g. nothing left in the draft vocabulary), and, with a
``stopper`` (the planner's :class:`~specgen.planning.chain.ChainStopper`), before a step
whose confidence (max q, or the drafter's own estimate; known before the draw) the stopper
declines, or after a draw when it says no further draft pays. All are rules of the drafter's own
information, so exactness holds. A stopper reads each step's confidence back as
it comes (one host read a step): meant for a CPU, where such reads cost nothing.
``strict_first``: a row that allows nothing at the
first step raises NoAllowedToken instead (the small model's first row follows the
committed tokens only, where plain decoding meets the same error). NaN logits
raise NumericalError.
"""

from __future__ import annotations

import torch

from specgen.drafters.base import EMPTY, DraftContext, Proposal
from specgen.errors import NumericalError
from specgen.processors import DeviceHistory, History
from specgen.sampling import NAN_CODE, NoAllowedToken, argmax_codes, draw_on_device, sample_token, uniforms
from specgen.sampling.probs import FORBIDDEN_MESSAGE, NAN_MESSAGE


class ChainDraws:
    """One proposal's draws. Call :meth:`draw` per step, then :meth:`finish` once."""

    def __init__(self, ctx: DraftContext, *, strict_first: bool, stopper=None):
        self.stack, self.committed, self.generator = ctx.stack, ctx.committed, ctx.generator
        self.stopper = stopper  # keep(confidence) -> bool before a draw, more() -> bool after one
        self.on_device = not self.stack.host_tokens
        self.strict_first = strict_first
        self.tokens: list = []  # host ints, or [1] long tensors on the device path
        self.rows: list[torch.Tensor] = []  # q of each step, [vocab] float64 (sampled only)
        self.peaks: list[torch.Tensor] = []  # max q before each draw: the planner's confidence
        self.checks: list[torch.Tensor] = []  # device path: argmax code or total mass per step, [1]
        self.drawn: list[int] = []  # device path, after finish: every drawn id, kept or not

    def draw(self, raw: torch.Tensor, greedy_peak_logits: torch.Tensor,
             confidence: torch.Tensor | None = None) -> int | torch.Tensor | None:
        """Draw the next token from raw logits [1, vocab] -> the token to feed next (an int,
        or a [1] long tensor on the device path), or None when the chain stops here (host
        path; the device path notices in :meth:`finish`).

        greedy_peak_logits: [V] logits whose softmax maximum is the confidence under greedy
        decoding (a sampled step's confidence is max q). confidence: [] the drafter's own
        estimate in [0, 1] that this step's token is accepted, used instead of either; it must
        be computed before this draw from the drafter's information (its state and the tokens
        drawn before this step), never from the token drawn here."""
        greedy = self.stack.greedy
        if confidence is not None:
            confidence = confidence.to(torch.float64)
        peak = confidence if confidence is not None or not greedy else \
            torch.softmax(greedy_peak_logits.float(), dim=-1).max()
        if greedy and not self._keep(peak):
            return None
        if self.on_device:
            drafted = torch.cat(self.tokens) if self.tokens else torch.zeros(0, dtype=torch.long, device=raw.device)
            history = DeviceHistory(self.committed, drafted)
            if greedy:
                code = argmax_codes(self.stack.logits(raw, history))  # [1]
                token = code.clamp_min(0)
                self.checks.append(code.to(torch.float64))
            else:
                q_row = self.stack.probs(raw, history)[0]  # [vocab] float64
                peak = q_row.max() if confidence is None else confidence
                if not self._keep(peak):
                    return None
                token, total = draw_on_device(q_row, uniforms(self.generator, 1))  # [1], [1]
                self.checks.append(total)
        else:
            history = History(self.committed, self.tokens, num_positions=1, start=len(self.tokens))
            try:
                if greedy:
                    token = self.stack.argmax(raw, history)[0]
                else:
                    q_row = self.stack.probs(raw, history)[0]  # [vocab] float64
                    peak = q_row.max() if confidence is None else confidence
                    if not self._keep(peak):
                        return None
                    token = sample_token(q_row, self.generator)
            except NoAllowedToken:
                if not self.tokens and self.strict_first:
                    raise
                return None
        if not greedy:
            self.rows.append(q_row)
        self.peaks.append(peak)
        self.tokens.append(token)
        return token

    def _keep(self, peak: torch.Tensor) -> bool:
        """Ask the stopper (if any) whether the step of confidence ``peak`` ([] tensor) is drawn.
        A NaN or empty row is always drawn: the draw (or :meth:`finish`) reports it as usual."""
        if self.stopper is None:
            return True
        value = float(peak)
        return not 0.0 < value <= 1.0 or self.stopper.keep(value)

    def more(self) -> bool:
        """After a draw: is another step wanted? (Always, without a stopper; the caller's budget ends it.)"""
        return self.stopper is None or self.stopper.more()

    def finish(self) -> Proposal:
        """The proposal: one read of everything on the device path (cut before a step that
        allowed nothing), one read of the confidences on the host path."""
        if not self.tokens:
            return EMPTY
        if not self.on_device:
            return self._proposal(list(self.tokens), len(self.tokens), torch.stack(self.peaks).tolist())
        count = len(self.tokens)
        values = torch.cat([torch.cat(self.tokens).to(torch.float64), torch.cat(self.checks),
                            torch.stack(self.peaks).to(torch.float64)]).tolist()
        self.drawn = [int(v) for v in values[:count]]
        checks, peaks = values[count: 2 * count], values[2 * count:]
        keep = count
        for step, check in enumerate(checks):
            if check != check or (self.stack.greedy and check == NAN_CODE):
                raise NumericalError(f"drafter: {NAN_MESSAGE}")
            if (check < 0) if self.stack.greedy else not check > 0.0:  # nothing allowed at this step
                if step == 0 and self.strict_first:
                    raise NoAllowedToken(f"drafter: {FORBIDDEN_MESSAGE}")
                keep = step
                break
        if not keep:
            return EMPTY
        return self._proposal(self.drawn, keep, peaks)

    def _proposal(self, tokens: list[int], keep: int, peaks: list[float]) -> Proposal:
        draft_probs = None if self.stack.greedy else torch.stack(self.rows[:keep])  # [keep, vocab]
        return Proposal(tokens[:keep], draft_probs, confidence=peaks[:keep])
