"""Token histories at a batch of positions, for processors that depend on them.

Position ``j`` of a batch sees the committed tokens plus the first ``j`` candidate
tokens. The committed part is kept as running count vectors by
:class:`CommittedCounts`; the candidate part is added on demand, so a stack with
no history-dependent processor pays nothing.
"""

from __future__ import annotations

from functools import cached_property

import torch


class CommittedCounts:
    """Running token statistics of the committed sequence of one request.

    tokens:    prompt + generated ids (append with :meth:`commit`, roll back with :meth:`truncate`)
    seen:      [vocab] how often each id occurs in prompt + generated tokens
    generated: [vocab] how often each id occurs in generated tokens only
    truncations: how many times :meth:`truncate` ran; while it stays the same, ``tokens`` only
               grew, so a reader that saw its first n tokens knows they are unchanged

    The count vectors are brought up to date when read, so a request whose processors
    never read them (greedy or plain sampling) pays one list append per committed token.
    """

    def __init__(self, tokens: list[int], num_prompt: int, vocab_size: int, device: torch.device):
        self.tokens = tokens
        self.num_prompt = num_prompt
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._seen: torch.Tensor | None = None  # [vocab], counts of tokens[:_counted]
        self._generated: torch.Tensor | None = None  # [vocab]
        self._counted = 0
        self.truncations = 0

    @classmethod
    def start(cls, prompt_ids: list[int], vocab_size: int, device: torch.device) -> CommittedCounts:
        return cls(list(prompt_ids), len(prompt_ids), vocab_size, device)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def seen(self) -> torch.Tensor:
        self._sync()
        return self._seen

    @property
    def generated(self) -> torch.Tensor:
        self._sync()
        return self._generated

    def _sync(self) -> None:
        """Count the tokens committed since the last read."""
        if self._seen is None:
            self._seen = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
            self._generated = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
        if self._counted < len(self.tokens):
            self._add(self._counted, len(self.tokens), 1.0)
            self._counted = len(self.tokens)

    def _add(self, begin: int, end: int, sign: float) -> None:
        """Add ``sign`` times the counts of ``tokens[begin:end]``."""
        ids = torch.tensor(self.tokens[begin:end], dtype=torch.long, device=self.device)
        self._seen.index_add_(0, ids, torch.full((end - begin,), sign, device=self.device))
        first = max(begin, self.num_prompt)
        if first < end:
            ids = ids[first - begin:]
            self._generated.index_add_(0, ids, torch.full((end - first,), sign, device=self.device))

    def commit(self, new_tokens: list[int]) -> None:
        """Append committed tokens (the counts follow when next read)."""
        self.tokens.extend(new_tokens)

    def truncate(self, length: int) -> None:
        """Roll the committed sequence back to ``length`` tokens (never into the prompt)."""
        if length < self.num_prompt:
            raise ValueError("cannot roll back into the prompt")
        self.truncations += 1
        if self._seen is not None and self._counted > length:
            self._add(length, self._counted, -1.0)
            self._counted = length
        del self.tokens[length:]


class History:
    """Histories for ``num_positions`` consecutive positions starting at ``start``.

    Row ``r`` describes position ``j = start + r``, whose history is the committed
    tokens + ``candidates[:j]``. Tensors are built lazily and cached.
    """

    def __init__(self, committed: CommittedCounts, candidates: list[int], num_positions: int, start: int = 0):
        if start + num_positions > len(candidates) + 1:
            raise ValueError("a position can only see candidates before it")
        self.committed = committed
        self.candidates = candidates[: max(start + num_positions - 1, 0)]
        self.num_positions = num_positions
        self.start = start

    def _candidate_prefix_counts(self) -> torch.Tensor:
        """[num_positions, vocab]: counts of candidates strictly before each row's position."""
        vocab = self.committed.vocab_size
        counts = torch.zeros(self.num_positions, vocab, device=self.committed.device)
        for j, token in enumerate(self.candidates):
            first_row = max(j + 1 - self.start, 0)
            if first_row < self.num_positions:
                counts[first_row:, token] += 1.0
        return counts

    @cached_property
    def seen_counts(self) -> torch.Tensor:
        """[num_positions, vocab] counts over prompt + generated + candidate prefix."""
        return self.committed.seen.unsqueeze(0) + self._prefix_counts

    @cached_property
    def generated_counts(self) -> torch.Tensor:
        """[num_positions, vocab] counts over generated + candidate prefix."""
        return self.committed.generated.unsqueeze(0) + self._prefix_counts

    @cached_property
    def _prefix_counts(self) -> torch.Tensor:
        return self._candidate_prefix_counts()

    @cached_property
    def num_generated(self) -> torch.Tensor:
        """[num_positions] number of generated tokens each row's position has seen."""
        base = self.committed.num_generated + self.start
        return torch.arange(base, base + self.num_positions, device=self.committed.device)

    def tail(self, row: int, length: int) -> list[int]:
        """The last ``length`` tokens of the history at ``row`` (fewer if shorter)."""
        if length <= 0:
            return []
        own = self.candidates[: self.start + row]
        if len(own) >= length:
            return own[len(own) - length :]
        need = length - len(own)
        return self.committed.tokens[-need:] + own if need else own

    def full(self, row: int) -> list[int]:
        """The whole token history at ``row`` (prompt included)."""
        return self.committed.tokens + self.candidates[: self.start + row]

    def draft_dependent(self, row: int) -> bool:
        """Whether ``row``'s history holds draft candidates (False: the committed position)."""
        return self.start + row > 0


class PathHistory(History):
    """Histories for positions on different draft paths, e.g. every node of a draft tree.

    Row ``r``'s history is the committed tokens + ``paths[r]`` (a list of candidate
    tokens; ``[]`` is the committed position). Same interface as :class:`History`,
    so every processor evaluates a whole tree's rows in one call; counts are built
    with one device scatter.
    """

    def __init__(self, committed: CommittedCounts, paths: list[list[int]]):
        self.committed = committed
        self.paths = [list(path) for path in paths]
        self.num_positions = len(self.paths)
        self.start = 0

    def _candidate_prefix_counts(self) -> torch.Tensor:
        """[num_positions, vocab]: counts of each row's path tokens."""
        device = self.committed.device
        vocab = self.committed.vocab_size
        rows = [r for r, path in enumerate(self.paths) for _ in path]
        tokens = [t for path in self.paths for t in path]
        counts = torch.zeros(self.num_positions, vocab, device=device)  # [N, vocab]
        if tokens:
            index = torch.tensor([rows, tokens], dtype=torch.long).to(device)  # [2, total path tokens]
            counts.index_put_((index[0], index[1]), torch.ones(len(tokens), device=device), accumulate=True)
        return counts

    @cached_property
    def num_generated(self) -> torch.Tensor:
        """[num_positions] number of generated tokens each row's position has seen."""
        base = self.committed.num_generated
        return torch.tensor([base + len(path) for path in self.paths]).to(self.committed.device)

    def tail(self, row: int, length: int) -> list[int]:
        if length <= 0:
            return []
        own = self.paths[row]
        if len(own) >= length:
            return own[len(own) - length :]
        need = length - len(own)
        return self.committed.tokens[-need:] + own

    def full(self, row: int) -> list[int]:
        return self.committed.tokens + self.paths[row]

    def draft_dependent(self, row: int) -> bool:
        return bool(self.paths[row])


class DeviceHistory(History):
    """The history of one position after draft tokens that stay on the device.

    candidates: [k] long tensor on the counts' device, the drafted tokens so far.
    Offers the count-based interface only (``seen_counts``, ``generated_counts``,
    ``num_generated``): ``tail``/``full`` would need the ids on the host, so a stack
    with a ``host_tokens`` processor cannot use it.
    """

    def __init__(self, committed: CommittedCounts, candidates: torch.Tensor):
        self.committed = committed
        self.device_candidates = candidates
        self.num_positions = 1
        self.start = int(candidates.shape[0])  # a shape, not a read

    def _candidate_prefix_counts(self) -> torch.Tensor:
        vocab = self.committed.vocab_size
        counts = torch.zeros(1, vocab, device=self.committed.device)  # [1, vocab]
        if self.start:
            ones = torch.ones(self.start, device=counts.device)
            counts[0].index_add_(0, self.device_candidates.to(counts.device), ones)
        return counts

    def tail(self, row: int, length: int) -> list[int]:
        raise TypeError("a device-resident draft history has no host token ids (Processor.host_tokens)")

    def full(self, row: int) -> list[int]:
        raise TypeError("a device-resident draft history has no host token ids (Processor.host_tokens)")
