"""The chat's data: the message tree, its SQLite store, JSON and Markdown files, commands
and key configuration (no model needed)."""

import json
import sqlite3

import pytest

pytest.importorskip("textual", reason="llm chat needs the chat extra (textual)")

from localllm.apps.tui import commands as cmds  # noqa: E402
from localllm.apps.tui.config import DEFAULT_KEYS, ConfigError, load_config  # noqa: E402
from localllm.apps.tui.export import ExportError, from_json, read_file, to_json, to_markdown, write_file  # noqa: E402
from localllm.apps.tui.store import Store, StoreError  # noqa: E402
from localllm.apps.tui.tree import Conversation, Message  # noqa: E402
from localllm.apps.tui.widgets import code_blocks  # noqa: E402


def branching(store):
    """user 1 -> (reply a | reply b) ; reply a -> user 2 -> reply c. Selected: b."""
    conv = Conversation(id=0, system="Be brief.", settings={"temperature": 0.5})
    u1 = store.add_message(conv, None, "user", "What is 2+2?")
    a = store.add_message(conv, u1.id, "assistant", "4")
    u2 = store.add_message(conv, a.id, "user", "And 3+3?")
    store.add_message(conv, u2.id, "assistant", "6", {"generated_tokens": 1})
    b = store.add_message(conv, u1.id, "assistant", "Four.")
    store.save_state(conv)
    return conv, u1, a, b


def test_tree_paths_siblings_and_selection(tmp_path):
    store = Store(tmp_path / "chat.db")
    conv, u1, a, b = branching(store)
    assert [m.content for m in conv.path()] == ["What is 2+2?", "Four."]
    assert conv.siblings(a.id) == [a.id, b.id]
    [bp] = conv.branch_points()
    assert (bp.index, bp.position, bp.count) == (1, 2, 2)
    # Going back to the first reply restores the branch below it as it was left.
    assert conv.step(b.id, -1) == a.id
    assert [m.content for m in conv.path()] == ["What is 2+2?", "4", "And 3+3?", "6"]
    assert conv.step(a.id, -1) is None
    assert conv.prompt()[0] == {"role": "system", "content": "Be brief."}
    assert conv.title == "What is 2+2?"


def test_store_round_trip_and_crash_safety(tmp_path):
    path = tmp_path / "data" / "chat.db"
    store = Store(path)
    conv, u1, a, b = branching(store)
    conv.select(a.id)
    store.save_state(conv)
    # A second connection (another process after a kill) sees every committed change.
    other = Store(path)
    back = other.load(conv.id)
    assert [m.content for m in back.path()] == ["What is 2+2?", "4", "And 3+3?", "6"]
    assert back.system == "Be brief." and back.settings == {"temperature": 0.5}
    assert back.path()[-1].meta == {"generated_tokens": 1}
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert other.latest() == conv.id
    [row] = other.summaries()
    assert (row.id, row.messages, row.title) == (conv.id, 5, "What is 2+2?")
    assert other.recent_prompts() == ["What is 2+2?", "And 3+3?"]
    with pytest.raises(StoreError, match="no conversation 99"):
        other.load(99)
    # A conversation without messages is not saved.
    empty = Conversation(id=0)
    store.save_state(empty)
    assert empty.id == 0 and len(other.summaries()) == 1


def test_store_rejects_a_file_that_is_not_a_database(tmp_path):
    bad = tmp_path / "chat.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="cannot open the chat database"):
        Store(bad)


def test_json_keeps_every_branch_and_markdown_the_one_on_screen(tmp_path):
    store = Store(":memory:")
    conv, u1, a, b = branching(store)
    f = write_file(conv, tmp_path / "c.json")
    back = read_file(f)
    assert to_json(back) == to_json(conv)
    copy = store.import_conversation(back)
    assert copy.id != conv.id
    assert [m.content for m in copy.path()] == [m.content for m in conv.path()]
    assert len(copy.messages) == 5 and len(copy.branch_points()) == 1
    md = write_file(conv, tmp_path / "c.md").read_text()
    assert "## Assistant (branch 2 of 2)\n\nFour." in md and "And 3+3?" not in md
    assert to_markdown(conv).startswith("# What is 2+2?")


@pytest.mark.parametrize("data, message", [
    ({"format": "x"}, "not a localllm-chat file"),
    ({"format": "localllm-chat", "version": 99}, "unsupported version"),
    ({"format": "localllm-chat", "version": 1, "messages": [
        {"id": 1, "parent": 7, "role": "user", "content": "hi"}]}, "not an earlier message"),
    ({"format": "localllm-chat", "version": 1, "messages": [
        {"id": 1, "parent": None, "role": "robot", "content": "hi"}]}, "needs \"role\""),
    ({"format": "localllm-chat", "version": 1, "messages": [
        {"id": 1, "parent": None, "role": "user", "content": "hi"}],
      "selection": {"root": 5}}, "not one of its children"),
])
def test_bad_conversation_files_get_one_line_errors(data, message):
    with pytest.raises(ExportError, match=message):
        from_json(data)


def test_unreadable_json_names_the_file(tmp_path):
    f = tmp_path / "broken.json"
    f.write_text("{ not json")
    with pytest.raises(ExportError, match=r"broken.json: not JSON .* line 1"):
        read_file(f)


def test_commands_and_hints():
    assert cmds.parse("/regen").name == "regen"
    assert cmds.parse("/system Be brief.").args == "Be brief."
    assert not cmds.is_command("//etc/passwd is a path")
    with pytest.raises(cmds.CommandError, match=r"did you mean /regen\?"):
        cmds.parse("/rgen")
    with pytest.raises(cmds.CommandError, match="unknown command /zzz: \\(/help"):
        cmds.parse("/zzz")
    cur = {"temperature": 0.8, "max_tokens": -1}
    assert cmds.parse_set("temp 0", cur) == ("temperature", 0.0)
    assert cmds.parse_set("seed random", cur) == ("seed", None)
    assert cmds.parse_set("max_tokens -5", cur) == ("max_tokens", -1)
    with pytest.raises(cmds.CommandError, match="is not a number"):
        cmds.parse_set("temp hot", cur)
    with pytest.raises(cmds.CommandError, match="top_p must be in"):
        cmds.parse_set("top_p 2", cur)
    with pytest.raises(cmds.CommandError, match="did you mean top_k"):
        cmds.parse_set("topk 5", cur)
    with pytest.raises(cmds.CommandError, match="usage: /set"):
        cmds.parse_set("temp", cur)


def test_key_config(tmp_path):
    assert load_config(tmp_path / "missing.toml").keys == DEFAULT_KEYS
    f = tmp_path / "chat.toml"
    f.write_text('[keys]\nsend = "ctrl+s"\nnewline = "enter, ctrl+j"\n')
    keys = load_config(f).keys
    assert keys["send"] == "ctrl+s" and keys["newline"] == "enter,ctrl+j"
    assert keys["quit"] == DEFAULT_KEYS["quit"]
    f.write_text('[keys]\nsned = "ctrl+s"\n')
    with pytest.raises(ConfigError, match="unknown action 'sned'"):
        load_config(f)
    f.write_text('[keys\n')
    with pytest.raises(ConfigError, match="chat.toml"):
        load_config(f)


def test_code_blocks():
    text = "Run:\n\n```python\nprint(1)\n```\n\nor\n\n    indented()\n"
    assert code_blocks(text) == ["print(1)\n", "indented()\n"]
    assert code_blocks("no code") == []


def test_import_keeps_file_order_of_parents():
    data = {"format": "localllm-chat", "version": 1, "messages": [
        {"id": 9, "parent": None, "role": "user", "content": "a"},
        {"id": 3, "parent": 9, "role": "assistant", "content": "b"}]}
    conv = Store(":memory:").import_conversation(from_json(json.loads(json.dumps(data))))
    assert [m.content for m in conv.path()] == ["a", "b"]
    assert isinstance(conv.path()[0], Message)


_FULL_DISK_CHILD = """
import os, resource, signal, sys
from localllm.apps.tui.store import Store, StoreError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
path = sys.argv[1]
store = Store(path)
conv = store.load(int(sys.argv[2]))
size = max(os.path.getsize(path + x) for x in ("", "-wal") if os.path.exists(path + x))
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 8192, size + 8192))
try:
    store.add_message(conv, conv.path()[-1].id, "user", "x" * (1 << 20))
except StoreError as e:
    print(e)
    sys.exit(3)
"""


def test_a_full_disk_while_writing_the_chat_keeps_the_previous_state(tmp_path):
    import subprocess
    import sys
    path = tmp_path / "chat.db"
    store = Store(path)
    conv, *_ = branching(store)
    before = [(m.role, m.content) for m in store.load(conv.id).path()]
    store.close()
    r = subprocess.run([sys.executable, "-c", _FULL_DISK_CHILD, str(path), str(conv.id)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, (r.stdout, r.stderr)
    assert "could not be written" in r.stdout and "nothing of this change" in r.stdout
    assert len(r.stdout.strip().splitlines()) == 1
    again = Store(path)
    assert [(m.role, m.content) for m in again.load(conv.id).path()] == before
    msg = again.add_message(again.load(conv.id), None, "user", "after the disk has room")
    assert msg.id > 0
