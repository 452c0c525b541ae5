"""What the chat app is started with, and the data it works on: the conversation on screen
and the database it is kept in."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .config import DEFAULT_KEYS
from .store import Store
from .tree import Conversation, Message


@dataclass
class ChatOptions:
    """Everything the app is started with; the command line builds it."""
    load: Callable[[], object]          # returns a loaded Model; runs on the engine thread
    model_label: str                    # what is being loaded (shown, and kept per conversation)
    database: Path | str
    clipboard: Path
    sampling: dict                      # SamplingParams fields; max_tokens -1: to the context end
    keys: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_KEYS))
    system: str = ""
    resume: int | None = None           # a conversation id


class ChatState:
    """The conversation on screen (``conv``, replaced by /clear and /load), the Store it is
    written to as it happens, and the options the app started with."""

    def __init__(self, options: ChatOptions):
        """Args:
            options: the app's start; ``resume`` names a stored conversation to open.
        """
        self.options = options
        self.store = Store(options.database)
        self.conv: Conversation = (self.store.load(options.resume) if options.resume is not None
                                   else self.new_conversation())

    def new_conversation(self) -> Conversation:
        """An unsaved conversation with the starting system prompt and settings (stored with
        its first message).

        Returns:
            The conversation, id 0.
        """
        return Conversation(id=0, model=self.options.model_label, system=self.options.system,
                            settings=dict(self.options.sampling))

    def sampling(self) -> dict:
        """The conversation's sampling settings over the starting ones (a loaded file may
        name only some).

        Returns:
            SamplingParams fields, a new dict.
        """
        return {**self.options.sampling, **self.conv.settings}

    def path_to(self, msg_id: int | None) -> list[Message]:
        """The path from the top of the conversation to a message.

        Args:
            msg_id: the last message of the path; None gives an empty path.
        Returns:
            The messages, oldest first.
        """
        out = []
        while msg_id is not None:
            m = self.conv.messages[msg_id]
            out.append(m)
            msg_id = m.parent_id
        return out[::-1]
