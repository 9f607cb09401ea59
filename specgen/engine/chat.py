"""A conversation as chat messages, and whether a pipeline applies its chat template:
what the chat UI and the server share.

A history whose tokenizer has no chat template (``use_template`` False) is
flattened into a ``User: ... / Assistant:`` transcript that ends where the
reply starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specgen.config.options import parse_chat


@dataclass
class ChatHistory:
    """The conversation so far, as chat messages.

    use_template: apply the tokenizer's chat template (else the history is
    flattened into a ``User: ... / Assistant:`` transcript, for tokenizers
    without one, e.g. ``target=tiny``).
    """

    use_template: bool
    messages: list[dict] = field(default_factory=list)

    def add(self, role: str, content: str) -> None:
        self.messages.append({"role": role, "content": content})

    def clear(self) -> None:
        self.messages.clear()

    def drop_last(self) -> None:
        """Forget the last message (a user turn whose reply failed, so it can be retried)."""
        if self.messages:
            self.messages.pop()

    def copy(self) -> ChatHistory:
        """A snapshot the reply worker can read while the UI thread goes on."""
        return ChatHistory(self.use_template, [dict(m) for m in self.messages])

    def droppable(self) -> list[int]:
        """How many of the oldest non-system messages may be left out: 0, then each count that
        leaves the kept turns starting with a user message and keeps the last message."""
        turns = [m for m in self.messages if m["role"] != "system"]
        return [0, *(n for n in range(1, len(turns)) if turns[n]["role"] == "user")]

    def drop_oldest(self, count: int) -> None:
        """Forget the ``count`` oldest non-system messages (system messages stay)."""
        turns = [m for m in self.messages if m["role"] != "system"][:count]
        self.messages = [m for m in self.messages if not any(m is t for t in turns)]

    def prompt(self, drop: int = 0) -> str | list[dict]:
        """What to pass to ``Pipeline.stream``: messages, or one transcript string.

        drop: leave out that many of the oldest non-system messages.
        """
        kept = self.copy()
        kept.drop_oldest(drop)
        if self.use_template:
            return kept.messages
        lines = [f"{_speaker(m)}: {m['content']}" for m in kept.messages]
        return "\n".join([*lines, "Assistant:"])

    def stop_strings(self, defaults: tuple[str, ...]) -> tuple[str, ...]:
        """Stop strings for a reply: a transcript also stops where the next user turn starts."""
        return defaults if self.use_template else (*defaults, "\nUser:")


def _speaker(message: dict) -> str:
    """A transcript line's speaker: the role, and the message's ``name`` when it has one (``User (ann)``)."""
    role = message["role"]
    speaker = {"user": "User", "assistant": "Assistant", "system": "System"}.get(role, role.title())
    return f"{speaker} ({message['name']})" if message.get("name") else speaker


def uses_template(pipe) -> bool:
    """Whether replies use the chat template: the ``chat`` setting, or auto-detected."""
    chat = parse_chat(pipe.defaults.chat)
    return pipe.tokenizer.has_chat_template if chat == "auto" else chat
