"""Conversations as files: JSON with every branch (``/save``, ``/load``, ``/export x.json``)
and Markdown of the branch on screen (``/export x.md``)."""

from __future__ import annotations

import json
from pathlib import Path

from .tree import ROLES, Conversation, Message

FORMAT = "localllm-chat"
VERSION = 1


class ExportError(ValueError):
    """A file that is not a conversation this version can read."""


def to_json(conv: Conversation) -> dict:
    """Every message and branch, the selection, system prompt and settings."""
    return {
        "format": FORMAT, "version": VERSION,
        "title": conv.title, "model": conv.model, "system": conv.system,
        "settings": conv.settings,
        "messages": [{"id": m.id, "parent": m.parent_id, "role": m.role,
                      "content": m.content, "meta": m.meta, "created": m.created}
                     for m in conv.messages.values()],
        "selection": {("root" if k is None else str(k)): v for k, v in conv.selection.items()},
    }


def from_json(data) -> Conversation:
    """A conversation from ``to_json``'s structure (ids as in the file; id 0).

    Raises:
        ExportError: naming the first thing that is wrong.
    """
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ExportError(f"not a {FORMAT} file (no \"format\": \"{FORMAT}\")")
    if not isinstance(data.get("version"), int) or data["version"] > VERSION:
        raise ExportError(f"unsupported version {data.get('version')!r} (this reads {VERSION})")
    conv = Conversation(id=0)
    for key in ("title", "model", "system"):
        value = data.get(key, "")
        if not isinstance(value, str):
            raise ExportError(f"\"{key}\" must be a string")
        setattr(conv, key, value)
    if not isinstance(data.get("settings", {}), dict):
        raise ExportError("\"settings\" must be an object")
    conv.settings = dict(data.get("settings", {}))
    msgs = data.get("messages")
    if not isinstance(msgs, list):
        raise ExportError("\"messages\" must be a list")
    for i, m in enumerate(msgs):
        where = f"message {i + 1}"
        if not isinstance(m, dict):
            raise ExportError(f"{where} is not an object")
        mid, parent = m.get("id"), m.get("parent")
        if not isinstance(mid, int) or mid in conv.messages:
            raise ExportError(f"{where}: \"id\" must be a unique integer")
        if parent is not None and parent not in conv.messages:
            raise ExportError(f"{where}: parent {parent!r} is not an earlier message")
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ExportError(f"{where}: needs \"role\" (user or assistant) and \"content\"")
        if not isinstance(m.get("meta", {}), dict):
            raise ExportError(f"{where}: \"meta\" must be an object")
        created = m.get("created", 0.0)
        conv.add(Message(mid, parent, m["role"], m["content"], dict(m.get("meta", {})),
                         float(created) if isinstance(created, (int, float)) else 0.0))
    sel = data.get("selection", {})
    if not isinstance(sel, dict):
        raise ExportError("\"selection\" must be an object")
    for k, v in sel.items():
        parent = None if k == "root" else (int(k) if str(k).lstrip("-").isdigit() else k)
        if (parent is not None and parent not in conv.messages) or v not in conv.messages \
                or conv.messages[v].parent_id != parent:
            raise ExportError(f"selection {k!r}: {v!r} is not one of its children")
        conv.selection[parent] = v
    return conv


def to_markdown(conv: Conversation) -> str:
    """The branch on screen as Markdown, noting where other branches exist."""
    out = [f"# {conv.title or 'Conversation'}", ""]
    if conv.model:
        out += [f"*Model: {conv.model}*", ""]
    if conv.system:
        out += ["## System", "", conv.system, ""]
    for m in conv.path():
        sibs = conv.siblings(m.id)
        note = f" (branch {sibs.index(m.id) + 1} of {len(sibs)})" if len(sibs) > 1 else ""
        dropped = " (left out of the context)" if m.meta.get("dropped") else ""
        out += [f"## {m.role.capitalize()}{note}{dropped}", "", m.content, ""]
    return "\n".join(out)


def write_file(conv: Conversation, path: str | Path, markdown: bool | None = None) -> Path:
    """Write ``conv`` to ``path``: Markdown for .md/.markdown (or ``markdown=True``), else JSON.

    Returns:
        The path written.
    """
    path = Path(path).expanduser()
    if markdown is None:
        markdown = path.suffix.lower() in (".md", ".markdown")
    text = to_markdown(conv) if markdown else json.dumps(to_json(conv), indent=1,
                                                         ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")
    return path


def read_file(path: str | Path) -> Conversation:
    """Read a JSON conversation file.

    Raises:
        ExportError: the file is not valid JSON or not a conversation.
        OSError: it cannot be read.
    """
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ExportError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError:
        raise ExportError(f"{path}: not UTF-8 text") from None
    try:
        return from_json(data)
    except ExportError as e:
        raise ExportError(f"{path}: {e}") from None
