"""The next message: where it goes in the tree (after the head, as an edit's new branch, or
as a new top-level branch from a summary) and the prompt box it is written in."""

from __future__ import annotations

from dataclasses import dataclass

from .tree import Conversation, Message
from .widgets import PromptInput


@dataclass
class ReplyTarget:
    """Where a new user message goes, and what changed before it (a key of CAUSES, or "")."""
    parent_id: int | None
    cause: str


@dataclass
class Draft:
    """What the next message is apart from its text; no widgets, so it can be reasoned about
    (and tested) on a Conversation alone."""
    editing: Message | None = None      # a user message being rewritten as a branch
    new_root: bool = False              # the next message starts a top-level branch
    cause: str = ""                     # what changed before the next turn (CAUSES)
    pending_text: str = ""              # a message sent back to the box by a full context

    def target(self, conv: Conversation) -> ReplyTarget:
        """Where the next message goes: after the head, as a sibling of the message being
        edited (or of an unanswered one), or as a new top-level branch.

        Args:
            conv: the conversation on screen.
        Returns:
            The parent of the new message and the cause to report with its reply.
        """
        head = conv.head()
        if self.new_root:
            return ReplyTarget(None, "summary")
        if self.editing is not None:
            return ReplyTarget(self.editing.parent_id, "edit")
        if head is not None and head.role == "user":
            return ReplyTarget(head.parent_id, self.cause)
        return ReplyTarget(head.id if head else None, self.cause)

    def activity(self, path: list[Message]) -> str:
        """The status bar's line about the draft, or "" for a plain next message.

        Args:
            path: the messages on screen.
        Returns:
            One line of text.
        """
        if self.editing is not None:
            n = sum(1 for m in path[:path.index(self.editing) + 1]
                    if m.role == "user") if self.editing in path else "?"
            return f"editing message {n}: Enter sends it as a new branch, Esc cancels"
        if self.new_root:
            return "the next message starts a new branch from the summary (Esc cancels)"
        return ""

    def reset(self, cause: str = "") -> None:
        """Back to a plain next message after the conversation changed under it."""
        self.editing, self.new_root, self.cause = None, False, cause


class Composer:
    """The prompt box and the Draft of the message written in it: edits, a summary offered
    as the start of a new branch, and a message a full context sent back."""

    def __init__(self, box: PromptInput):
        """Args:
            box: the prompt box (not yet mounted).
        """
        self.box = box
        self.draft = Draft()

    def start_edit(self, msg: Message) -> None:
        """Put a user message in the box; sending it makes a new branch at that message."""
        self.draft.editing, self.draft.new_root = msg, False
        self.box.set_text(msg.content)
        self.box.focus()

    def leave(self) -> bool:
        """Cancel an edit or a new branch from a summary, emptying the box.

        Returns:
            Whether there was one to cancel.
        """
        if self.draft.editing is None and not self.draft.new_root:
            return False
        self.draft.editing, self.draft.new_root = None, False
        self.box.set_text("")
        return True

    def sent(self) -> None:
        """The message is stored: the next one is plain again."""
        self.draft.editing, self.draft.new_root = None, False

    def put_back(self, text: str) -> None:
        """A message that was not sent goes back to the box, unless something new is there."""
        if not self.box.text:
            self.box.set_text(text)

    def give_back(self, text: str) -> None:
        """A message the context had no room for: in the box, and kept to offer again after
        /clear or /drop."""
        self.box.set_text(text)
        self.draft.pending_text = text

    def restore_pending(self) -> None:
        """Offer the message a full context sent back again, if the box is empty."""
        if self.draft.pending_text and not self.box.text.strip():
            self.box.set_text(self.draft.pending_text)
        self.draft.pending_text = ""

    def offer_summary(self, summary: str) -> None:
        """Put a summary (and any message sent back) in the box as the start of a new
        top-level branch."""
        pending = self.draft.pending_text
        self.draft.pending_text = ""
        self.draft.new_root, self.draft.editing = True, None
        self.box.set_text(f"Summary of our conversation so far:\n\n{summary}\n\n{pending}")
        self.box.focus()
