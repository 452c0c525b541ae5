"""`llm chat` driven through textual's Pilot with the real SmolLM2 model: streamed replies,
stopping, branches, settings, files, a full context, keys and copies."""

import asyncio
import json
import threading

import pytest

pytest.importorskip("textual", reason="llm chat needs the chat extra (textual)")

from localllm.apps.tui.app import ChatApp, ChatOptions  # noqa: E402
from localllm.apps.tui.events import ReplyChunk  # noqa: E402
from localllm.apps.tui.export import to_json  # noqa: E402
from localllm.apps.tui.pilot import say, until  # noqa: E402
from localllm.apps.tui.store import Store  # noqa: E402
from localllm.apps.tui.widgets import MessageView, NoteView  # noqa: E402

CTX = 1024


@pytest.fixture(scope="module")
def model(smollm_path):
    import localllm
    m = localllm.load(smollm_path, ctx_size=CTX)
    # Compile the kernels a reply runs before any test times the app (this is the first
    # module to run them in a fresh process).
    for _ in m.generate([1, 2, 3], max_tokens=2, temperature=0.0):
        pass
    yield m
    m.close()


class ObservedApp(ChatApp):
    """The real app, counting the streamed pieces it shows (textual runs the handler of
    each class in the hierarchy, so ChatApp's own still shows them)."""

    chunks = 0
    hold_after: int | None = None    # the engine thread waits after posting this many pieces
    posted = 0

    def __init__(self, options):
        super().__init__(options)
        self.released = threading.Event()

    def on_reply_chunk(self, event):
        self.chunks += 1

    def post_message(self, message) -> bool:
        # Posted from the engine thread: holding it there makes a stop land mid-reply however
        # fast the model writes (a 135M model can finish 300 tokens before the UI catches up).
        ok = super().post_message(message)
        if isinstance(message, ReplyChunk) and self.hold_after is not None \
                and threading.current_thread() is not threading.main_thread():
            self.posted += 1
            if self.posted >= self.hold_after:
                self.released.wait(60)
        return ok

    async def stop_mid_reply(self, pilot, key: str) -> None:
        """Press ``key`` while the engine thread is held after its third piece, then let it
        go on: it must see the stop before it writes another token."""
        await until(pilot, lambda: self.chunks >= 3)
        await pilot.press(key)
        self.released.set()
        await until(pilot, lambda: not self.generating)


@pytest.fixture
def make_app(model, tmp_path):
    def make(**options):
        sampling = dict(temperature=0.0, max_tokens=8, top_k=40, top_p=0.95, min_p=0.05,
                        repeat_penalty=1.0, seed=None)
        sampling.update(options.pop("sampling", {}))
        opts = ChatOptions(load=lambda: model, model_label="smollm2-135m",
                           database=tmp_path / "chat.db", clipboard=tmp_path / "clip.txt",
                           sampling=sampling, **options)
        return ObservedApp(opts)
    return make


def drive(app, script, size=(100, 40)):
    """Run ``script(pilot)`` against the app once the model is loaded."""
    async def main():
        async with app.run_test(size=size) as pilot:
            await until(pilot, lambda: app.chat_model is not None)
            await script(pilot)
    asyncio.run(main())


def status(app) -> str:
    return str(app.query_one("#status").render())


def notes(app) -> list[str]:
    return [str(n.render()) for n in app.query(NoteView)]


def shown(app) -> list[tuple[str, str]]:
    return [(v.role, v.text) for v in app.chat_view.message_views()]


def test_two_messages_stream_and_the_second_reuses_the_first(make_app, model):
    app = make_app()

    async def script(pilot):
        for ch in "Hello!":
            await pilot.press(ch)
        await pilot.press("enter")
        await pilot.pause()
        await until(pilot, lambda: not app.generating)
        first_chunks = app.chunks
        await say(pilot, "What is your name?")
        assert first_chunks >= 2 and app.chunks - first_chunks >= 2   # streamed, not at once
        path = app.conv.path()
        assert [m.role for m in path] == ["user", "assistant", "user", "assistant"]
        assert shown(app) == [(m.role, m.content) for m in path]
        # The reply is the engine's own greedy text for the same conversation.
        expect = "".join(model.chat([{"role": "user", "content": "Hello!"}],
                                    temperature=0, max_tokens=8))
        assert path[1].content == expect
        s = app.replies.last_stats
        assert s.cached_tokens > 0 and s.prompt_tokens - s.cached_tokens < 20
        assert f"reused {s.cached_tokens}/{s.prompt_tokens} prompt tokens" in status(app)
        assert "CPU 30/30 layers" in status(app) and f"/{CTX}" in status(app)
        assert s.reuse_note == ""
        await say(pilot, "/stats")
        assert f"prompt {s.prompt_tokens} tokens, {s.cached_tokens} reused" in notes(app)[-1]
    drive(app, script)


def test_escape_stops_a_reply_and_keeps_its_text(make_app):
    app = make_app()
    app.hold_after = 3

    async def script(pilot):
        await say(pilot, "/set max_tokens 300")
        app.prompt_box.set_text("Write a long story about a dragon who learns to bake bread.")
        await pilot.press("enter")
        await app.stop_mid_reply(pilot, "escape")
        reply = app.conv.path()[-1]
        assert reply.role == "assistant" and reply.content.strip()
        assert reply.meta["finish_reason"] == "cancelled"
        assert 3 <= reply.meta["generated_tokens"] < 300
        assert shown(app)[-1] == ("assistant", reply.content)
        assert "(stopped)" in str(app.chat_view.message_views()[-1].header.render())
        # Kept in the database as it was shown.
        back = Store(app.options.database).load(app.conv.id)
        assert back.path()[-1].content == reply.content
    drive(app, script)


def test_ctrl_c_stops_once_and_quits_twice(make_app):
    app = make_app(sampling={"max_tokens": 300})
    app.hold_after = 3

    async def script(pilot):
        app.prompt_box.set_text("Write a long story about a dragon who learns to bake bread.")
        await pilot.press("enter")
        await app.stop_mid_reply(pilot, "ctrl+c")
        assert app.conv.path()[-1].meta["finish_reason"] == "cancelled"
        assert app.return_code is None     # one Ctrl+C only stops the reply
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.return_code == 0      # exit() was called: the app is closing
    drive(app, script)


def test_regen_makes_a_branch_and_switching_back_restores_the_first(make_app):
    app = make_app(sampling={"max_tokens": 24})

    async def script(pilot):
        await say(pilot, "Tell me about dragons.")
        first = app.conv.path()[-1]
        await say(pilot, "/set temp 1.5")
        await say(pilot, "/set seed 3")
        await say(pilot, "/regen")
        second = app.conv.path()[-1]
        assert second.id != first.id and second.parent_id == first.parent_id
        assert second.content != first.content
        assert "2/2" in str(app.chat_view.message_views()[-1].header.render())
        await pilot.press("alt+left")          # the last branch point, from the prompt box
        await pilot.pause()
        assert app.conv.path()[-1].id == first.id
        assert shown(app)[-1] == ("assistant", first.content)
        assert "1/2" in str(app.chat_view.message_views()[-1].header.render())
        await say(pilot, "/branch 2")
        assert app.conv.path()[-1].id == second.id
        await pilot.press("alt+up")             # onto the reply: Alt+Left switches that one
        await pilot.press("alt+left")
        await pilot.pause()
        assert app.conv.path()[-1].id == first.id
        assert app.focused.message.id == first.id
        await pilot.press("alt+right")
        await pilot.pause()
        assert app.conv.path()[-1].id == second.id
        await say(pilot, "/branch")
        assert "message 2 (reply): branch 2 of 2" in notes(app)[-1]
        # The selection is saved: reopening shows the same branch.
        assert Store(app.options.database).load(app.conv.id).path()[-1].id == second.id
        # Going on from the first branch: its tip kept its own KV (the second branch was a
        # fork), so only the new turn is computed.
        await pilot.press("alt+left")
        await say(pilot, "Go on.")
        s = app.replies.last_stats
        assert s.reuse_note == "" and "recomputed" not in status(app)
        # everything of the first branch but its reply's last token (sampled, never run)
        assert s.cached_tokens >= first.meta["prompt_tokens"] + first.meta["generated_tokens"] - 1
    drive(app, script)


def test_greedy_regen_twice_gives_identical_replies(make_app):
    app = make_app(sampling={"temperature": 0.8})

    async def script(pilot):
        await say(pilot, "/set temp 0")
        await say(pilot, "Say something about the sea.")
        await say(pilot, "/regen")
        await say(pilot, "/regen")
        user = app.conv.path()[0]
        replies = [app.conv.messages[i] for i in app.conv.children[user.id]]
        assert len(replies) == 3
        assert replies[0].content == replies[1].content == replies[2].content
        assert all(r.meta["finish_reason"] in ("stop", "length") for r in replies)
        # Regenerating reruns only the prompt's last token.
        assert app.replies.last_stats.prompt_tokens - app.replies.last_stats.cached_tokens == 1
    drive(app, script)


def test_edit_makes_a_branch_at_that_message(make_app):
    app = make_app()

    async def script(pilot):
        await say(pilot, "Hi there.")
        await say(pilot, "What is 2+2?")
        await say(pilot, "/edit 1")
        assert app.prompt_box.text == "Hi there." and "editing message 1" in status(app)
        await say(pilot, "Good morning.")
        path = app.conv.path()
        assert [m.content for m in path[:1]] == ["Good morning."] and len(path) == 2
        first = app.conv.children[None]
        assert len(first) == 2     # the old message and its turns are kept
        assert app.replies.last_stats.reuse_note == ""    # a fork at the edit: nothing recomputed
        # A new system prompt changes the start of the history: said, not hidden.
        await say(pilot, "/system Answer like a pirate.")
        await say(pilot, "Thanks.")
        note = app.replies.last_stats.reuse_note
        assert note.startswith("the system prompt changed: the prompt differs from the cached")
        assert "recomputed: the system prompt changed" in status(app)
    drive(app, script)


def test_summary_starts_a_new_branch_from_it(make_app):
    app = make_app()

    async def script(pilot):
        await say(pilot, "My name is Ada and I like rivers.")
        await say(pilot, "/summary")
        box = app.prompt_box.text
        assert box.startswith("Summary of our conversation so far:\n\n") and app.composer.draft.new_root
        summary = box.split("\n\n", 1)[1].strip()
        assert summary and "new branch" in status(app)
        await say(pilot, box + "What do I like?")
        first = app.conv.children[None]
        assert len(first) == 2                     # the old branch is kept beside the new
        assert app.conv.path()[0].content.startswith("Summary of our conversation so far:")
        assert app.conv.path()[-1].role == "assistant" and not app.composer.draft.new_root
    drive(app, script)


def test_save_then_load_restores_the_conversation(make_app, tmp_path):
    app = make_app()
    f = tmp_path / "saved.json"

    async def script(pilot):
        await say(pilot, "/system Answer in one word.")
        await say(pilot, "Name a fruit.")
        await say(pilot, "/set temp 1.5")
        await say(pilot, "/set seed 11")
        await say(pilot, "/regen")
        await say(pilot, f"/save {f}")
        saved = to_json(app.conv)
        await say(pilot, "/clear")
        assert shown(app) == []
        await say(pilot, f"/load {f}")
        loaded = to_json(app.conv)
        assert loaded["system"] == "Answer in one word." and loaded["settings"]["seed"] == 11
        strip = lambda d: [(m["role"], m["content"]) for m in d["messages"]]  # noqa: E731
        assert strip(loaded) == strip(saved)
        assert [(r, c) for r, c in shown(app)] == [(m.role, m.content) for m in app.conv.path()]
        assert len(app.conv.branch_points()) == 1
        await say(pilot, f"/export {tmp_path / 'out.md'}")
        assert "Name a fruit." in (tmp_path / "out.md").read_text()
        await say(pilot, "/load /no/such/file.json")
        assert "no such file" in notes(app)[-1].lower()
    drive(app, script)


def long_conversation(tmp_path, turns=3, repeats=11):
    text = " ".join(["The old mill stands by the river and grinds the wheat for the village."]
                    * repeats)
    msgs, sel = [], {}
    for i in range(turns):
        u, a = 2 * i + 1, 2 * i + 2
        msgs += [{"id": u, "parent": u - 1 if i else None, "role": "user", "content": text},
                 {"id": a, "parent": u, "role": "assistant", "content": text}]
    f = tmp_path / "long.json"
    f.write_text(json.dumps({"format": "localllm-chat", "version": 1, "messages": msgs,
                             "selection": sel}))
    return f


def test_a_full_context_asks_and_never_cuts(make_app, tmp_path):
    app = make_app()
    f = long_conversation(tmp_path)

    async def script(pilot):
        await say(pilot, f"/load {f}")
        before = len(app.conv.messages)
        await say(pilot, "And then?")
        assert len(app.conv.messages) == before            # nothing sent, nothing cut
        note = notes(app)[-1]
        assert "context is full" in note and "/clear" in note and "/summary" in note
        assert "/drop 1" in note
        assert app.prompt_box.text == "And then?"          # the message is kept
        await say(pilot, "/drop 1")
        assert app.prompt_box.text == "And then?"
        assert app.conv.path()[0].meta["dropped"] and not app.conv.path()[2].meta.get("dropped")
        await say(pilot, app.prompt_box.text)
        assert app.conv.path()[-1].role == "assistant" and app.conv.path()[-1].content
        assert app.replies.last_stats.prompt_tokens < CTX
        assert "left out of the context" in str(app.chat_view.message_views()[0].header.render())
    drive(app, script)


def test_keys_newlines_history_and_remapping(make_app, tmp_path):
    Store(tmp_path / "chat.db").close()
    seed = Store(tmp_path / "chat.db")
    from localllm.apps.tui.tree import Conversation
    seed.add_message(Conversation(id=0), None, "user", "an earlier prompt")
    seed.close()
    app = make_app(keys={"send": "ctrl+s"})

    async def script(pilot):
        box = app.prompt_box
        await pilot.press("up")
        assert box.text == "an earlier prompt"
        await pilot.press("down")
        assert box.text == ""
        for key in ("a", "ctrl+j", "b", "alt+enter", "c", "shift+enter", "d", "enter", "e"):
            await pilot.press(key)
        assert box.text == "a\nb\nc\nd\ne"     # Enter is a new line once send is Ctrl+S
        await pilot.press("ctrl+s")
        await pilot.pause()
        await until(pilot, lambda: not app.generating)
        assert app.conv.path()[0].content == "a\nb\nc\nd\ne" and box.text == ""
        await pilot.press("up")
        assert box.text == "a\nb\nc\nd\ne"
    drive(app, script)


def test_unknown_and_mistyped_commands_get_hints(make_app):
    app = make_app()

    async def script(pilot):
        await say(pilot, "/regn")
        assert "did you mean /regen?" in notes(app)[-1]
        await say(pilot, "/set temp warm")
        assert "'warm' is not a number" in notes(app)[-1]
        await say(pilot, "/edit")
        assert "no message to edit yet" in notes(app)[-1]
        await say(pilot, "/help")
        assert "/branch" in notes(app)[-1] and "ctrl+j" in notes(app)[-1]
        assert app.conv.messages == {}
    drive(app, script)


def test_copy_a_message_and_its_code(make_app, tmp_path):
    app = make_app()
    reply = "Use this:\n\n```python\nprint('hi')\n```\n"
    f = tmp_path / "code.json"
    f.write_text(json.dumps({"format": "localllm-chat", "version": 1, "messages": [
        {"id": 1, "parent": None, "role": "user", "content": "Print hi in Python."},
        {"id": 2, "parent": 1, "role": "assistant", "content": reply}]}))

    async def script(pilot):
        await say(pilot, f"/load {f}")
        await pilot.press("alt+up")             # onto the last message
        assert isinstance(app.focused, MessageView) and app.focused.role == "assistant"
        await pilot.press("y")
        assert app.clipboard == "print('hi')\n"
        assert (tmp_path / "clip.txt").read_text() == "print('hi')\n"
        await pilot.press("c")
        assert app.clipboard == reply
        await pilot.press("escape")
        assert app.focused is app.prompt_box
        await say(pilot, "/copy code 1")
        assert app.clipboard == "print('hi')\n"
    drive(app, script)


def test_a_model_that_does_not_load_is_reported_and_nothing_is_sent(tmp_path):
    import localllm
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    app = ChatApp(ChatOptions(load=lambda: localllm.load(bad), model_label=str(bad),
                              database=tmp_path / "chat.db", clipboard=tmp_path / "clip.txt",
                              sampling={"temperature": 0.0, "max_tokens": 8}))

    async def main():
        async with app.run_test() as pilot:
            await until(pilot, lambda: any(n.startswith("error") for n in notes(app)))
            assert app.replies.load_error and notes(app)[-1].startswith(f"error: cannot load {bad}: ")
            assert "\n" not in notes(app)[-1]
            app.prompt_box.set_text("Hello?")
            await pilot.press("enter")
            await pilot.pause()
            assert app.conv.messages == {} and app.prompt_box.text == "Hello?"
            assert "the model did not load" in status(app)
    asyncio.run(main())


def test_status_bar_reports_drafts(smollm_path, tmp_path):
    import localllm
    with localllm.load(smollm_path, ctx_size=CTX, lookup=10) as m:
        app = ObservedApp(ChatOptions(
            load=lambda: m, model_label="smollm2-135m", database=tmp_path / "chat.db",
            clipboard=tmp_path / "clip.txt", sampling=dict(temperature=0.0, max_tokens=24)))

        async def script(pilot):
            await say(pilot, "Say: The lighthouse keeper climbed the spiral stairs every "
                             "evening at dusk, carrying a can of oil and a cloth.")
            s = app.replies.last_stats
            assert s.draft_tokens > 0 and 0 <= s.accepted_tokens <= s.draft_tokens
            assert f"{s.tokens_per_pass:.2f} tok/pass" in status(app)
            await say(pilot, "/stats")
            assert f"{s.accepted_tokens} of {s.draft_tokens} drafted tokens" in notes(app)[-1]
        drive(app, script)
