"""`llm chat` as a person runs it: a real process in a real terminal (tmux), typing keys,
reading the screen; killed mid-reply and resumed. Also its command-line errors."""

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

pytest.importorskip("textual", reason="llm chat needs the chat extra (textual)")

LLM = [sys.executable, "-m", "localllm.apps.cli"]
KITTY_SHIFT_ENTER = "\x1b[13;2u"    # what a terminal with the Kitty protocol sends


def chat_env(tmp_path) -> dict:
    return {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"),
            "XDG_CONFIG_HOME": str(tmp_path / "config"), "PYTHONWARNINGS": "ignore"}


def rows(db_path) -> list[tuple[str, str]]:
    if not db_path.exists():
        return []
    with sqlite3.connect(db_path) as db:
        return db.execute("SELECT role, content FROM messages ORDER BY id").fetchall()


class Terminal:
    """One tmux server of our own (its own socket, no user config) running one command."""

    def __init__(self, tmp_path, name):
        self.base = ["tmux", "-L", f"llm-chat-test-{os.getpid()}-{name}", "-f", os.devnull]
        self.env = chat_env(tmp_path)

    def start(self, *args, cols=100, lines=32):
        cmd = " ".join(["exec"] + [f"'{a}'" for a in LLM + list(args)])
        subprocess.run(self.base + ["new-session", "-d", "-s", "main", "-x", str(cols),
                                    "-y", str(lines), cmd], check=True, env=self.env)

    def start_chat(self, *args):
        """``llm chat ARGS``, once its model is loaded."""
        self.start("chat", *args)
        self.wait(lambda: "loaded in" in self.screen(), "model loaded")

    def tmux(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run(self.base + list(args), capture_output=True, text=True,
                              env=self.env)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "main").stdout

    def type(self, text):
        self.tmux("send-keys", "-t", "main", "-l", text)

    def press(self, *keys):
        self.tmux("send-keys", "-t", "main", *keys)

    def pid(self) -> int:
        return int(self.tmux("display-message", "-p", "-t", "main", "#{pane_pid}").stdout)

    def alive(self) -> bool:
        return self.tmux("has-session", "-t", "main").returncode == 0

    def wait(self, cond, what, timeout=300.0):
        t0 = time.monotonic()
        while not cond():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"no {what} after {timeout:.0f} s; screen:\n{self.screen()}")
            if not self.alive():
                raise AssertionError(f"the chat exited while waiting for {what}")
            time.sleep(0.2)

    def exited(self, timeout=30.0) -> bool:
        """Wait for the command (and with it the session) to end."""
        deadline = time.monotonic() + timeout
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        return not self.alive()

    def close(self):
        self.tmux("kill-server")


@pytest.fixture
def terminal(tmp_path):
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux): no real terminal to test in")
    made = []

    def make(name):
        made.append(Terminal(tmp_path, name))
        return made[-1]
    yield make
    for t in made:
        t.close()


def test_typing_a_message_in_a_real_terminal(terminal, tmp_path, smollm_path):
    db = tmp_path / "data" / "localllm" / "chat.db"
    t = terminal("type")
    t.start_chat(str(smollm_path), "-n", "8", "--temp", "0")
    # Alt+Enter as legacy terminals send it (ESC CR) and Shift+Enter as the Kitty protocol
    # reports it both break the line; Enter sends.
    t.type("Hello")
    t.press("M-Enter")
    t.type("there")
    t.type(KITTY_SHIFT_ENTER)
    t.type("friend")
    t.press("Enter")
    t.wait(lambda: len(rows(db)) == 2, "stored reply")
    (_, prompt), (_, reply) = rows(db)
    assert prompt == "Hello\nthere\nfriend"
    t.wait(lambda: reply.splitlines()[0][:30] in t.screen(), "reply on screen")
    # The reply is stored before the status line takes its final figures: wait for them.
    t.wait(lambda: "reused 0/" in t.screen(), "the finished reply's status line")
    assert "CPU 30/30 layers" in t.screen()
    t.press("C-q")
    assert t.exited()


def test_killed_mid_reply_then_resume_shows_every_completed_turn(terminal, tmp_path,
                                                                 smollm_path):
    db = tmp_path / "data" / "localllm" / "chat.db"
    t = terminal("kill")
    t.start_chat(str(smollm_path), "-n", "8", "--temp", "0")
    t.type("Hello!")
    t.press("Enter")
    t.wait(lambda: len(rows(db)) == 2, "first reply stored")
    first_reply = rows(db)[1][1]
    t.type("/set max_tokens 400")
    t.press("Enter")
    t.type("Write a long story about a dragon who learns to bake.")
    t.press("Enter")

    def writing():
        lines = t.screen().splitlines()
        heads = [i for i, ln in enumerate(lines) if "Assistant" in ln and "writing" in ln]
        return heads and len(lines) > heads[-1] + 1 and lines[heads[-1] + 1].strip(" █")
    t.wait(writing, "the second reply streaming")
    os.kill(t.pid(), signal.SIGKILL)
    assert t.exited()
    stored = rows(db)
    assert [r for r, _ in stored] == ["user", "assistant", "user"]    # the reply being written
    assert stored[2][1] == "Write a long story about a dragon who learns to bake."

    r = terminal("resume")
    r.start_chat("--resume")
    r.wait(lambda: "/regen answers it" in r.screen(), "the note on the unanswered message")
    screen = r.screen()
    assert "Hello!" in screen and first_reply.splitlines()[0][:30] in screen
    assert "Write a long story about a dragon who learns to bake." in screen
    r.press("C-q")


def test_list_and_command_line_errors(tmp_path, smollm_path):
    env = chat_env(tmp_path)
    run = lambda *a: subprocess.run(LLM + list(a), capture_output=True, text=True,  # noqa: E731
                                    env=env, stdin=subprocess.DEVNULL, timeout=120)
    r = run("chat", "--list")
    assert r.returncode == 0 and "no saved conversations" in r.stderr
    from localllm.apps.tui.store import Store
    from localllm.apps.tui.tree import Conversation
    store = Store(tmp_path / "data" / "localllm" / "chat.db")
    conv = Conversation(id=0, model="smollm2-135m")
    store.add_message(conv, None, "user", "Where is the moon?")
    store.close()
    r = run("chat", "--list")
    assert r.returncode == 0
    assert r.stdout.splitlines()[0].split()[:3] == ["ID", "UPDATED", "MESSAGES"]
    assert f"{conv.id} " in r.stdout and "Where is the moon?" in r.stdout
    r = run("chat", "--resume", "99")
    assert r.returncode == 1 and r.stderr.strip() == \
        "error: no conversation 99 (see `llm chat --list`)"
    r = run("chat", "--resume", "abc")
    assert r.returncode == 1 and "takes a conversation id" in r.stderr
    r = run("chat", str(smollm_path))
    assert r.returncode == 1 and "needs a terminal" in r.stderr
    r = run("chat", "--temp", "-1")
    assert r.returncode == 2 and r.stderr.startswith("error: temperature must be >= 0")
