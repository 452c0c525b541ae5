"""`llm chat` from the command line: list saved conversations, or resolve the model and the
conversation to resume, then run the app."""

from __future__ import annotations

import sys
import time

from .config import default_paths, load_config
from .store import Store, StoreError


def list_conversations() -> int:
    """Print the saved conversations, most recent first."""
    paths = default_paths()
    if not paths.database.exists():
        print(f"no saved conversations (none in {paths.database})", file=sys.stderr)
        return 0
    store = Store(paths.database)
    try:
        rows = store.summaries()
    finally:
        store.close()
    if not rows:
        print(f"no saved conversations in {paths.database}", file=sys.stderr)
        return 0
    table = [("ID", "UPDATED", "MESSAGES", "MODEL", "TITLE")]
    table += [(str(r.id), time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated)),
               str(r.messages), r.model, r.title) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[4])
    return 0


def _resume_id(store: Store, resume: str) -> int:
    if resume == "latest":
        latest = store.latest()
        if latest is None:
            raise StoreError("no saved conversation to resume")
        return latest
    try:
        return int(resume)
    except ValueError:
        raise StoreError(f"--resume takes a conversation id, got {resume!r} "
                         "(see `llm chat --list`)") from None


def run_chat(model: str | None, settings: dict, sampling: dict, system: str | None,
             resume: str | None) -> int:
    """Run the chat app until the user quits.

    Args:
        model: a path or known name; None: the resumed conversation's, else the default.
        settings: LoadSettings fields; sampling: SamplingParams fields (max_tokens -1: no limit).
        system: the system prompt for a new conversation.
        resume: a conversation id, "latest", or None for a new conversation.
    Returns:
        The exit code.
    """
    from localllm.api import load
    from localllm.formats.fetch import DEFAULT_MODEL, resolve_model_path
    from .app import ChatApp, ChatOptions
    paths = default_paths()
    config = load_config(paths.config)
    conv_id = None
    if resume is not None:
        store = Store(paths.database)
        try:
            conv_id = _resume_id(store, resume)
            saved = store.load(conv_id)
        finally:
            store.close()
        model = model or saved.model or None
    if not sys.stdin.isatty() or not sys.stderr.isatty():   # textual draws on stderr
        raise ValueError("llm chat needs a terminal (for pipes and scripts use `llm run`)")
    label = model or DEFAULT_MODEL
    # Fetching a known model prints its progress here, before the screen is taken over.
    path = resolve_model_path(model, settings.get("models_dir"), download=True)
    app = ChatApp(ChatOptions(load=lambda: load(path, **settings), model_label=label,
                              database=paths.database, clipboard=paths.clipboard,
                              sampling=sampling, keys=config.keys, system=system or "",
                              resume=conv_id))
    app.run()
    if app.conv.id:
        print(f"conversation {app.conv.id} saved: llm chat --resume {app.conv.id}",
              file=sys.stderr)
    return app.return_code or 0
