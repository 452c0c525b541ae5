"""Conversations kept in SQLite as they happen: one transaction per change, WAL journal, so
a crash or kill loses at most the reply being written."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .tree import Conversation, Message

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    system TEXT NOT NULL DEFAULT '',
    settings TEXT NOT NULL DEFAULT '{}',
    selection TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    parent_id INTEGER REFERENCES messages(id),
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    meta TEXT NOT NULL DEFAULT '{}',
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id);
"""


class StoreError(ValueError):
    """The conversation database cannot be used (wrong file, newer schema, missing id)."""


@dataclass
class ConversationSummary:
    """A row of ``llm chat --list``."""
    id: int
    title: str
    model: str
    messages: int
    updated: float


def _selection_to_json(sel: dict[int | None, int]) -> str:
    return json.dumps({("root" if k is None else str(k)): v for k, v in sel.items()})


def _selection_from_json(text: str) -> dict[int | None, int]:
    return {(None if k == "root" else int(k)): int(v) for k, v in json.loads(text).items()}


class Store:
    """The chat database. Every method that changes something commits before returning."""

    def __init__(self, path: str | Path):
        """Args:
            path: the SQLite file (created with its folder), or ":memory:".
        """
        self.path = Path(path) if str(path) != ":memory:" else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(str(path), isolation_level=None)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(f"{path} was written by a newer localllm (schema {version})")
            if version == 0:
                self.db.executescript(
                    f"BEGIN IMMEDIATE; {_SCHEMA} PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
        except sqlite3.DatabaseError as e:
            raise StoreError(f"cannot open the chat database {path}: {e}") from None

    def _tx(self):
        return _Transaction(self.db)

    def close(self) -> None:
        self.db.close()

    # ---- conversations --------------------------------------------------------------

    def _insert_conversation(self, conv: Conversation) -> None:
        conv.created = conv.updated = time.time()
        cur = self.db.execute(
            "INSERT INTO conversations (title, model, system, settings, created, updated) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (conv.title, conv.model, conv.system, json.dumps(conv.settings), conv.created,
             conv.updated))
        conv.id = cur.lastrowid

    def add_message(self, conv: Conversation, parent_id: int | None, role: str, content: str,
                    meta: dict | None = None) -> Message:
        """Append a message under ``parent_id`` and select it, in one transaction (which
        first saves the conversation itself if it is new, id 0)."""
        now = time.time()
        new = conv.id == 0
        try:
            with self._tx():
                if new:
                    self._insert_conversation(conv)
                cur = self.db.execute(
                    "INSERT INTO messages (conversation_id, parent_id, role, content, meta, "
                    "created) VALUES (?, ?, ?, ?, ?, ?)",
                    (conv.id, parent_id, role, content, json.dumps(meta or {}), now))
                msg = Message(cur.lastrowid, parent_id, role, content, dict(meta or {}), now)
                conv.add(msg)
                self._touch(conv)
        except BaseException:
            if new:
                conv.id = 0
            raise
        return msg

    def set_meta(self, conv: Conversation, msg: Message, **meta) -> None:
        """Update flags or statistics of a stored message."""
        msg.meta.update(meta)
        with self._tx():
            self.db.execute("UPDATE messages SET meta=? WHERE id=?", (json.dumps(msg.meta), msg.id))
            self._touch(conv)

    def save_state(self, conv: Conversation) -> None:
        """Save the branch selection, system prompt and settings (a conversation without
        messages is saved with its first one)."""
        if conv.id == 0:
            return
        with self._tx():
            self._touch(conv)

    def _touch(self, conv: Conversation) -> None:
        conv.updated = time.time()
        self.db.execute(
            "UPDATE conversations SET title=?, model=?, system=?, settings=?, selection=?, "
            "updated=? WHERE id=?",
            (conv.title, conv.model, conv.system, json.dumps(conv.settings),
             _selection_to_json(conv.selection), conv.updated, conv.id))

    def load(self, conv_id: int) -> Conversation:
        """Read a conversation with every branch.

        Raises:
            StoreError: no conversation has that id.
        """
        row = self.db.execute(
            "SELECT id, title, model, system, settings, selection, created, updated "
            "FROM conversations WHERE id=?", (conv_id,)).fetchone()
        if row is None:
            raise StoreError(f"no conversation {conv_id} (see `llm chat --list`)")
        conv = Conversation(id=row[0], title=row[1], model=row[2], system=row[3],
                            settings=json.loads(row[4]), created=row[6], updated=row[7])
        for mid, parent, role, content, meta, created in self.db.execute(
                "SELECT id, parent_id, role, content, meta, created FROM messages "
                "WHERE conversation_id=? ORDER BY id", (conv_id,)):
            conv.add(Message(mid, parent, role, content, json.loads(meta), created))
        conv.selection.update(_selection_from_json(row[5]))
        return conv

    def import_conversation(self, src: Conversation) -> Conversation:
        """Store a copy of a conversation read from a file, with new ids, in one transaction."""
        with self._tx():
            conv = Conversation(id=0, title=src.title, model=src.model, system=src.system,
                                settings=dict(src.settings))
            self._insert_conversation(conv)
            new_id: dict[int, int] = {}
            for m in src.messages.values():  # insertion order: parents first
                parent = None if m.parent_id is None else new_id[m.parent_id]
                cur = self.db.execute(
                    "INSERT INTO messages (conversation_id, parent_id, role, content, meta, "
                    "created) VALUES (?, ?, ?, ?, ?, ?)",
                    (conv.id, parent, m.role, m.content, json.dumps(m.meta), m.created))
                new_id[m.id] = cur.lastrowid
                conv.add(Message(cur.lastrowid, parent, m.role, m.content, dict(m.meta), m.created))
            conv.selection = {(None if k is None else new_id[k]): new_id[v]
                              for k, v in src.selection.items()}
            self._touch(conv)
        return conv

    def latest(self) -> int | None:
        """The id of the most recently changed conversation, or None."""
        row = self.db.execute("SELECT id FROM conversations ORDER BY updated DESC, id DESC "
                              "LIMIT 1").fetchone()
        return row[0] if row else None

    def recent_prompts(self, limit: int = 200) -> list[str]:
        """The latest distinct user messages of every conversation, oldest first."""
        rows = self.db.execute(
            "SELECT content FROM messages WHERE role='user' GROUP BY content "
            "ORDER BY MAX(id) DESC LIMIT ?", (limit,)).fetchall()
        return [r[0] for r in reversed(rows)]

    def summaries(self) -> list[ConversationSummary]:
        """Every conversation, most recent first."""
        rows = self.db.execute(
            "SELECT c.id, c.title, c.model, COUNT(m.id), c.updated FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id "
            "ORDER BY c.updated DESC, c.id DESC").fetchall()
        return [ConversationSummary(*r) for r in rows]


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on error (the connection is in autocommit
    mode, so each change is exactly one transaction)."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb):
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        except sqlite3.DatabaseError as e:  # a COMMIT that cannot be written (a full disk)
            if exc_type is None:
                try:
                    self.db.execute("ROLLBACK")
                except sqlite3.DatabaseError:
                    pass  # no transaction left open
                exc_type, exc = type(e), e
        if exc_type is not None and issubclass(exc_type, sqlite3.DatabaseError):
            # The transaction is rolled back: the database keeps its previous state.
            raise StoreError(f"the chat database could not be written ({exc}); "
                             "nothing of this change was saved") from None
        return False
