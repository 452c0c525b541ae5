"""A conversation as a tree of messages: every regenerated answer or edited prompt is a new
sibling, and a selection per parent says which branch is on screen."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

ROLES = ("user", "assistant")


@dataclass
class Message:
    """One message of the tree. ``meta`` holds a reply's statistics and flags such as
    ``dropped`` (kept on screen, left out of the model's context)."""
    id: int
    parent_id: int | None
    role: str
    content: str
    meta: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)


@dataclass
class BranchPoint:
    """A message on the current path that has siblings."""
    index: int          # position on the path (0-based)
    message: Message
    position: int       # 1-based rank among its siblings
    count: int


@dataclass
class Conversation:
    """The tree, its system prompt and sampling settings. Ids come from the store."""
    id: int
    title: str = ""
    model: str = ""
    system: str = ""
    settings: dict = field(default_factory=dict)
    messages: dict[int, Message] = field(default_factory=dict)
    children: dict[int | None, list[int]] = field(default_factory=dict)
    # parent id (None for the first messages) -> the child shown on screen
    selection: dict[int | None, int] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def add(self, msg: Message) -> None:
        """Insert a message (its parent first) and put it on the current path."""
        if msg.role not in ROLES:
            raise ValueError(f"unknown role {msg.role!r}")
        if msg.parent_id is not None and msg.parent_id not in self.messages:
            raise ValueError(f"message {msg.id} has an unknown parent {msg.parent_id}")
        self.messages[msg.id] = msg
        self.children.setdefault(msg.parent_id, []).append(msg.id)
        self.selection[msg.parent_id] = msg.id
        if not self.title and msg.role == "user":
            self.title = title_of(msg.content)

    def path(self) -> list[Message]:
        """The messages on screen, oldest first: selected children from the top down."""
        out: list[Message] = []
        parent: int | None = None
        while self.children.get(parent):
            kids = self.children[parent]
            pick = self.selection.get(parent)
            if pick not in kids:
                pick = kids[-1]
            out.append(self.messages[pick])
            parent = pick
        return out

    def head(self) -> Message | None:
        """The last message on the current path."""
        p = self.path()
        return p[-1] if p else None

    def siblings(self, msg_id: int) -> list[int]:
        return self.children[self.messages[msg_id].parent_id]

    def select(self, msg_id: int) -> None:
        """Put a message on the current path (below it, each node keeps its own choice)."""
        m = self.messages[msg_id]
        while True:
            self.selection[m.parent_id] = m.id
            if m.parent_id is None:
                return
            m = self.messages[m.parent_id]

    def step(self, msg_id: int, delta: int) -> int | None:
        """Select the sibling ``delta`` places from ``msg_id``; returns it, or None at an end."""
        sibs = self.siblings(msg_id)
        i = sibs.index(msg_id) + delta
        if not 0 <= i < len(sibs):
            return None
        self.select(sibs[i])
        return sibs[i]

    def branch_points(self) -> list[BranchPoint]:
        """Messages on the current path that have siblings, oldest first."""
        out = []
        for i, m in enumerate(self.path()):
            sibs = self.siblings(m.id)
            if len(sibs) > 1:
                out.append(BranchPoint(i, m, sibs.index(m.id) + 1, len(sibs)))
        return out

    def prompt(self, path: list[Message] | None = None) -> list[dict]:
        """The chat messages the model sees: the system prompt, then the path without
        messages dropped from the context."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for m in self.path() if path is None else path:
            if not m.meta.get("dropped"):
                msgs.append({"role": m.role, "content": m.content})
        return msgs


def title_of(text: str, width: int = 60) -> str:
    """A one-line title from a message's first line."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[:width - 1] + "…"
