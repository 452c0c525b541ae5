"""Messages between the engine thread and the app, and the request for one turn."""

from __future__ import annotations

from dataclasses import dataclass

from textual.message import Message as TextualMessage

from .adapter import ChatModel, ContextUsage, Reply


@dataclass
class ReplyRequest:
    """A turn for the engine thread: an optional new prompt, then a reply."""
    messages: list[dict]        # what the model sees, ending with the user's message
    sampling: dict
    cause: str                  # what changed since the last reply, for the reuse note
    user_text: str | None       # a new user message to store first; None: regenerate
    parent_id: int | None       # the new user message's parent, or the user message replied to


class Loaded(TextualMessage):
    """The model is loaded."""

    def __init__(self, chat_model: ChatModel):
        super().__init__()
        self.chat_model = chat_model


class ReplyStarted(TextualMessage):
    """The prompt is stored (if new) and fits: the reply begins."""

    def __init__(self, parent_id: int, usage: ContextUsage):
        super().__init__()
        self.parent_id, self.usage = parent_id, usage


class ReplyChunk(TextualMessage):
    """A piece of the reply, the tokens so far and the context in use."""

    def __init__(self, text: str, tokens: int, usage: ContextUsage):
        super().__init__()
        self.text, self.tokens, self.usage = text, tokens, usage


class ReplyThinking(TextualMessage):
    """A piece of a reasoning model's thinking, and the tokens of thinking so far."""

    def __init__(self, text: str, tokens: int):
        super().__init__()
        self.text, self.tokens = text, tokens


class ReplyDone(TextualMessage):
    """The reply ended (finished, stopped or cut by a full context)."""

    def __init__(self, parent_id: int, reply: Reply):
        super().__init__()
        self.parent_id, self.reply = parent_id, reply


class ContextFull(TextualMessage):
    """The turn does not fit: nothing was sent; ``drop_hint`` turns would make room."""

    def __init__(self, request: ReplyRequest, needed: int, drop_hint: int | None):
        super().__init__()
        self.request, self.needed, self.drop_hint = request, needed, drop_hint


class Counted(TextualMessage):
    """The current branch was counted, for the context meter."""

    def __init__(self, usage: ContextUsage):
        super().__init__()
        self.usage = usage


class EngineFailed(TextualMessage):
    """The engine thread raised (loading or replying)."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error


class SummaryDone(TextualMessage):
    """/summary has its text."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text
