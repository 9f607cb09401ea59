"""The training loop: teacher-forced (and unrolled) batches, AdamW with warmup +
cosine decay, resumable checkpoints.

Positions: the target distribution p_j is computed from the final hidden
state at j and predicts token j + 1. From a start position i,

* EAGLE / MTP step 1 reads (feature_i, token_{i+1}) and predicts p_{i+1}; step
  k > 1 reads its own state from step k - 1 and token_{i+k} and predicts
  p_{i+k} ("training-time test": the head learns from its own predictions).
* Medusa head k (0-based) reads feature_i and predicts p_{i+1+k}.
* A DSpark head's block reads (feature_i, token_{i+1}) once; its position k
  (1-based) predicts p_{i+k} with the data's token_{i+k} as the Markov input
  x_{k-1} (teacher forcing). Its loss is ``train.loss`` summed over the block
  positions plus ``train.confidence_weight`` times the confidence loss against
  c*_k = 1 - TV(q_k, p_k) (:mod:`specgen.train.losses`).
* EAGLE-3 (attention) heads train on windows of ``train.window`` consecutive
  starts, so step 1 attends to the window's earlier positions and step k to its
  own earlier steps (:meth:`specgen.heads.eagle3.Eagle3Head.ttt_logits`).

So a start i needs depth D (= train.unroll, K Medusa heads, or a DSpark block's size) positions of
look-ahead. Batches are sampled with an explicit ``torch.Generator`` whose
state is checkpointed, so a resumed run is step-for-step the same run.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specgen.config.checks import NumberRange, check_number
from specgen.errors import ConfigError
from specgen.heads.modules import DraftHead
from specgen.train.data import Features, lm_logits
from specgen.config.options import parse_int, parse_seed
from specgen.outputs import describe, replace_atomically
from specgen.train.losses import (
    CONFIDENCE_LOSSES,
    LOSSES,
    acceptance,
    confidence_loss,
    confidence_target,
    depth_loss,
    summed_depth_loss,
)


@dataclass
class Settings:
    loss: str = "lk"
    steps: int = 2000
    batch_tokens: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    unroll: int = 3
    window: int = 64
    checkpoint_every: int = 200
    confidence_loss: str = "bce"  # dspark heads only, as confidence_weight
    confidence_weight: float = 1.0

    @classmethod
    def from_config(cls, train: dict) -> Settings:
        """The loop's settings from the ``train`` group (a key missing or null keeps its default).

        ConfigError naming the first bad ``train.*`` value; nothing is converted (``train.steps=2.7``
        is refused, not cut to 2; ``train.lr=abc`` is one line, not a ValueError from float()).
        """
        s = cls(**{name: train[name] for name in cls.__dataclass_fields__ if train.get(name) is not None})
        if s.loss not in LOSSES:
            raise ConfigError(f"train.loss must be one of {', '.join(LOSSES)}, got {s.loss!r}")
        if s.confidence_loss not in CONFIDENCE_LOSSES:
            raise ConfigError(f"train.confidence_loss must be one of {', '.join(CONFIDENCE_LOSSES)}, "
                              f"got {s.confidence_loss!r}")
        for name, minimum in _INTEGERS.items():
            setattr(s, name, parse_int(getattr(s, name), f"train.{name}", minimum=minimum))
        s.seed = parse_seed(s.seed, "train.seed")
        for name, limits in _NUMBERS.items():
            setattr(s, name, check_number(getattr(s, name), f"train.{name}", limits))
        return s

    def signature(self, kind: str) -> dict:
        """What a checkpoint of a ``kind`` head must match to resume (settings that head does not read left out)."""
        out = dict(self.__dict__)
        out.pop("checkpoint_every")
        if kind != "dspark":
            for name in _DSPARK_ONLY:
                out.pop(name)
        return out


#: The settings only a dspark head's training reads.
_DSPARK_ONLY = ("confidence_loss", "confidence_weight")


#: The integer settings and their least values (checkpoint_every 0 = no periodic checkpoints).
_INTEGERS = {"steps": 1, "batch_tokens": 1, "unroll": 1, "window": 1, "warmup_steps": 0, "checkpoint_every": 0}
#: The real-valued settings (grad_clip 0 = no clipping).
_NUMBERS = {"lr": NumberRange(0.0, False, None, "a finite number > 0"),
            "weight_decay": NumberRange(0.0, True, None, "a finite number >= 0"),
            "min_lr_ratio": NumberRange(0.0, True, 1.0, "in [0, 1]"),
            "grad_clip": NumberRange(0.0, True, None, "a finite number >= 0 (0 = off)"),
            "confidence_weight": NumberRange(0.0, True, None, "a finite number >= 0 (0 = off)")}


def depth_of(head: DraftHead, unroll: int) -> int:
    """Draft positions trained per start: Medusa's heads, a DSpark block's size, else ``unroll``."""
    if head.cfg.kind == "medusa":
        return head.cfg.num_heads
    return head.cfg.block_size if head.cfg.kind == "dspark" else int(unroll)


def draft_lookup(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] target id -> draft index (-1 where the id is not in the draft vocabulary)."""
    table = torch.full((max(vocab_size, int(vocab_ids.max()) + 1),), -1, dtype=torch.long)
    table[vocab_ids.cpu()] = torch.arange(len(vocab_ids))
    return table


def batch_targets(head: DraftHead, feats: Features, lookup: torch.Tensor, starts: torch.Tensor, depth: int,
                  device: torch.device):
    """-> (inputs [B, F], tokens [D, B], p [D, B, Vd], greedy draft index [D, B] (-1 = outside))."""
    ahead = starts.unsqueeze(0) + torch.arange(1, depth + 1).unsqueeze(1)  # [D, B]
    source = feats.hidden if head.cfg.kind == "medusa" else feats.inputs
    inputs = source[starts].to(device, torch.float32)
    tokens = feats.tokens[ahead].to(device)
    hidden = feats.hidden[ahead].to(device)  # [D, B, d] as stored
    logits = lm_logits(hidden, head.lm_rows.to(device))  # [D, B, Vd] float32, the product the cached lse used
    p = torch.exp(logits - feats.lse[ahead].to(device).unsqueeze(-1))
    greedy = lookup[feats.argmax[ahead]].to(device)
    return inputs, tokens, p, greedy


def window_starts(feats: Features, depth: int, window: int) -> tuple[torch.Tensor, int]:
    """(first starts of every window of ``window`` consecutive starts with ``depth`` look-ahead
    inside one sequence, the window length) -- shorter when no sequence is long enough."""
    longest = max((int(b) - int(a) - depth for a, b in zip(feats.offsets[:-1], feats.offsets[1:])), default=0)
    window = max(1, min(window, longest))
    parts = [torch.arange(int(a), int(b) - depth - window + 1) for a, b in zip(feats.offsets[:-1], feats.offsets[1:])
             if int(b) - int(a) - depth >= window]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)), window


def head_logits(head: DraftHead, inputs: torch.Tensor, tokens: torch.Tensor,
                windows: tuple[int, int] | None = None) -> torch.Tensor:
    """Draft logits [D, B, Vd] for the chain (EAGLE/MTP, D = len(tokens)), the K Medusa heads or
    a DSpark block (teacher-forced Markov inputs).

    windows: (W, T) when the B = W * T starts are W windows of T consecutive
    positions (an attention head's training-time test); None = one window."""
    if head.cfg.kind == "medusa":
        return head(inputs)
    if head.cfg.kind == "dspark":
        return head.teacher_forced(inputs, tokens)[0]
    if head.cfg.kind == "eagle3":
        w, t = windows or (1, inputs.shape[0])
        logits = head.ttt_logits(inputs.reshape(w, t, -1), tokens.reshape(tokens.shape[0], w, t))  # [D, W, T, Vd]
        return logits.reshape(tokens.shape[0], w * t, -1)
    state, out = inputs, []
    for k in range(tokens.shape[0]):
        state, logits = head.step(state, tokens[k])
        out.append(logits)
    return torch.stack(out)


def batch_loss(head: DraftHead, s: Settings, inputs: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor,
               greedy: torch.Tensor, windows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's training loss -> (loss [], draft logits [D, B, Vd]); arguments as :func:`batch_targets`
    returns them. A DSpark head's: ``s.loss`` summed over its positions plus ``s.confidence_weight`` times
    its confidence loss against c* = 1 - TV(q, p), q detached; every other head's: ``s.loss`` over depths."""
    if head.cfg.kind != "dspark":
        logits = head_logits(head, inputs, tokens, windows)
        return depth_loss(s.loss, logits, p, greedy), logits
    logits, confidence = head.teacher_forced(inputs, tokens)  # [D, B, Vd], [D, B]
    loss = summed_depth_loss(s.loss, logits, p, greedy)
    if s.confidence_weight:
        target = confidence_target(logits, p)  # [D, B]
        loss = loss + s.confidence_weight * confidence_loss(s.confidence_loss, confidence, target)
    return loss, logits


def _lr_lambda(s: Settings):
    warm = max(1, min(s.warmup_steps, s.steps // 5 or 1))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        t = (step - warm) / max(1, s.steps - warm)
        return s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
    return f


@dataclass
class TrainResult:
    steps: int
    seconds: float
    losses: list[float] = field(default_factory=list)  # one per step of this run (resumed runs: from the resume)
    resumed_from: int = 0
    interrupted: bool = False

    @property
    def steps_per_s(self) -> float:
        return (self.steps - self.resumed_from) / max(self.seconds, 1e-9)


@dataclass
class _State:
    """Everything a checkpoint restores: the head, optimiser, schedule, batch RNG and step."""

    head: DraftHead
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    gen: torch.Generator
    signature: str
    step: int = 0

    def save(self, path: Path | None) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"head": self.head.state_dict(), "opt": self.opt.state_dict(), "sched": self.sched.state_dict(),
                 "gen": self.gen.get_state(), "step": self.step, "signature": self.signature}
        replace_atomically(path, lambda tmp: torch.save(state, tmp))  # OSError: the last checkpoint stays whole

    def load(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", weights_only=True)
        if state.get("signature") != self.signature:
            raise ConfigError(f"checkpoint {path} was written by a run with other settings; "
                              "delete it or set train.resume=false")
        self.head.load_state_dict(state["head"])
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.gen.set_state(state["gen"])
        self.step = int(state["step"])


def _start(head: DraftHead, s: Settings, signature: str) -> tuple[_State, list[torch.Tensor]]:
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=s.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(s))
    return _State(head, opt, sched, torch.Generator().manual_seed(s.seed), signature), params


def _step(st: _State, params: list[torch.Tensor], feats: Features, lookup: torch.Tensor, starts: torch.Tensor,
          width: int, depth: int, s: Settings, device: torch.device) -> tuple[float, float]:
    """One optimiser step on a batch of windows drawn from ``st.gen`` -> (loss, mean depth-1 acceptance)."""
    count = max(1, s.batch_tokens // width)
    pick = starts[torch.randint(0, starts.numel(), (count,), generator=st.gen)]  # [W] window starts
    pick = (pick.unsqueeze(1) + torch.arange(width)).reshape(-1)  # [W * T]
    inputs, tokens, p, greedy = batch_targets(st.head, feats, lookup, pick, depth, device)
    loss, logits = batch_loss(st.head, s, inputs, tokens, p, greedy, (count, width))
    st.opt.zero_grad(set_to_none=True)
    loss.backward()
    if s.grad_clip:
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
    st.opt.step()
    st.sched.step()
    st.step += 1
    value = float(loss.detach())
    if not math.isfinite(value):
        raise ConfigError(f"the loss became {value} at step {st.step}; lower train.lr")
    return value, float(acceptance(logits[0].detach(), p[0]).mean())


def train_head(head: DraftHead, feats: Features, lookup: torch.Tensor, s: Settings, *, device: torch.device,
               checkpoint: Path | None = None, resume: bool = False, extra_signature: dict | None = None,
               stop_after: int | None = None, progress: bool = True) -> TrainResult:
    """Train ``head`` in place (parameters float32 on ``device``).

    stop_after: end (with a checkpoint) once this step is reached, as an
    interruption would; Ctrl-C does the same."""
    from tqdm import tqdm

    depth = depth_of(head, s.unroll)
    starts, width = window_starts(feats, depth, s.window) if head.cfg.kind == "eagle3" else (feats.starts(depth), 1)
    if starts.numel() == 0:
        raise ConfigError(f"no training position has {depth} tokens of look-ahead; raise train.max_len "
                          "or train.num_conversations")
    signature = json.dumps({"settings": s.signature(head.cfg.kind), **(extra_signature or {})}, sort_keys=True)
    st, params = _start(head, s, signature)
    if resume and checkpoint is not None and checkpoint.is_file():
        st.load(checkpoint)
    result = TrainResult(steps=st.step, seconds=0.0, resumed_from=st.step)
    head.train()
    bar = tqdm(total=s.steps, initial=st.step, desc=f"train {head.cfg.kind}/{s.loss}", disable=not progress,
               file=sys.stderr, dynamic_ncols=True)
    ema_loss = ema_acc = None
    t0 = time.perf_counter()
    try:
        while st.step < s.steps:
            if stop_after is not None and st.step >= stop_after:
                result.interrupted = True
                break
            value, acc = _step(st, params, feats, lookup, starts, width, depth, s, device)
            result.losses.append(value)
            ema_loss = value if ema_loss is None else 0.95 * ema_loss + 0.05 * value
            ema_acc = acc if ema_acc is None else 0.95 * ema_acc + 0.05 * acc
            bar.update(1)
            bar.set_postfix(loss=f"{ema_loss:.3f}", acc1=f"{ema_acc:.3f}", refresh=False)
            if s.checkpoint_every and st.step % s.checkpoint_every == 0 and st.step < s.steps:
                try:
                    st.save(checkpoint)
                except OSError as exc:  # a checkpoint insures the run; a full disk does not stop it
                    bar.write(f"specgen-train: checkpoint {checkpoint} not written ({describe(exc)}); training goes on",
                              file=sys.stderr)
    except KeyboardInterrupt:
        result.interrupted = True
    finally:
        bar.close()
        result.seconds = time.perf_counter() - t0
        result.steps = st.step
    if result.interrupted:
        st.save(checkpoint)
    head.eval()
    return result
