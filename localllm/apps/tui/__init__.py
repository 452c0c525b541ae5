"""`llm chat`: a terminal chat (textual) with branching history kept in SQLite.

The app (app.py) talks to the engine only through adapter.py; the tree of messages
(tree.py), its database (store.py) and files (export.py) know nothing of textual.
"""
