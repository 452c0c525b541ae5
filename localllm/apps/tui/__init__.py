"""`llm chat`: a terminal chat (textual) with branching history kept in SQLite.

ChatApp (app.py) lays out the widgets and wires the parts: the prompt line and keys
(composer.py, actions.py, handlers.py for the slash commands that commands.py parses), the
conversation on screen (view.py, widgets.py) and the engine side (replies.py), which talks
to the engine only through adapter.py. The tree of messages (tree.py), its database
(store.py) and files (export.py) know nothing of textual.
"""
