"""The chat app's parts on their own, without the model or the whole app: where the draft
sends the next message, the conversation log under a bare textual App, and the wiring of
every key to an action the app has."""

import asyncio

import pytest

pytest.importorskip("textual", reason="llm chat needs the chat extra (textual)")

from textual.app import App  # noqa: E402

from localllm.apps.tui import actions  # noqa: E402
from localllm.apps.tui.app import ChatApp  # noqa: E402
from localllm.apps.tui.composer import Draft, ReplyTarget  # noqa: E402
from localllm.apps.tui.store import Store  # noqa: E402
from localllm.apps.tui.tree import Conversation  # noqa: E402
from localllm.apps.tui.view import ConversationLog, shared_start  # noqa: E402
from localllm.apps.tui.widgets import MessageView, NoteView  # noqa: E402


@pytest.fixture
def branched():
    """user 1 -> (reply a | reply b, selected) -> user 2 (unanswered, under b)."""
    store = Store(":memory:")
    conv = Conversation(id=0)
    u1 = store.add_message(conv, None, "user", "Name a river.")
    a = store.add_message(conv, u1.id, "assistant", "The Nile.")
    b = store.add_message(conv, u1.id, "assistant", "The Danube.")
    u2 = store.add_message(conv, b.id, "user", "How long is it?")
    return conv, u1, a, b, u2


def test_the_draft_sends_after_the_head_or_beside_what_it_replaces(branched):
    conv, u1, a, b, u2 = branched
    draft = Draft(cause="system")
    # The head is an unanswered message: the new one goes beside it, keeping the cause.
    assert draft.target(conv) == ReplyTarget(b.id, "system")
    conv.select(a.id)
    assert draft.target(conv) == ReplyTarget(a.id, "system")      # after a reply: below it
    draft.editing = u1
    assert draft.target(conv) == ReplyTarget(None, "edit")        # beside the edited one
    draft.new_root = True
    assert draft.target(conv) == ReplyTarget(None, "summary")     # a summary wins over an edit
    assert Draft().target(Conversation(id=0)) == ReplyTarget(None, "")
    draft.reset("load")
    assert draft == Draft(cause="load")


def test_the_draft_names_the_message_being_edited(branched):
    conv, u1, a, b, u2 = branched
    draft = Draft(editing=u2)
    assert draft.activity(conv.path()).startswith("editing message 2:")
    conv.select(a.id)        # the edited message is on another branch now
    assert draft.activity(conv.path()).startswith("editing message ?:")
    assert "new branch from the summary" in Draft(new_root=True).activity(conv.path())
    assert Draft().activity(conv.path()) == ""


def test_shared_start_stops_at_the_first_difference(branched):
    conv, u1, a, b, u2 = branched
    assert shared_start([u1, b, u2], [u1, b, u2]) == 3
    assert shared_start([u1, b, u2], [u1, a]) == 1
    assert shared_start([u1, None], [u1, b]) == 1      # a view not stored yet is rebuilt
    assert shared_start([], [u1]) == 0


class LogApp(App):
    """Only the conversation log, as ChatApp lays it out."""

    def compose(self):
        yield ConversationLog(id="log")


def test_the_log_keeps_the_shared_start_and_rebuilds_the_rest(branched):
    conv, u1, a, b, u2 = branched
    app = LogApp()

    async def main():
        async with app.run_test(size=(80, 30)) as pilot:
            log = app.query_one(ConversationLog)
            await log.show(conv)
            views = log.message_views()
            assert [v.message.id for v in views] == [u1.id, b.id, u2.id]
            assert "2/2" in str(views[1].header.render())
            assert "2/2" not in str(views[0].header.render())
            await log.note("a notice", key="tmp")
            await log.note("another")
            conv.select(a.id)
            await log.show(conv)
            after = log.message_views()
            assert after[0] is views[0]             # the shared start is kept as it was
            assert [v.message.id for v in after] == [u1.id, a.id]
            assert "1/2" in str(after[1].header.render())
            assert not app.query(NoteView)          # notes after the cut go with it
            await log.note("kept", key="k")
            await log.note("also kept")
            await log.remove_note("k")
            assert [str(n.render()) for n in app.query(NoteView)] == ["also kept"]
            # A reply being written: not stored, streamed, then handed back.
            await log.add_prompt(conv, "And the Rhine?")
            await log.start_reply(conv)
            await log.write("It is ")
            await log.write("long.")
            streamed = log.take_reply()
            assert isinstance(streamed, MessageView) and streamed.text == "It is long."
            assert "writing" in str(streamed.header.render())
            assert log.take_reply() is None
            await streamed.end_stream()
            await pilot.pause()
    asyncio.run(main())


def test_every_key_names_an_action_of_the_app():
    for binding in actions.BINDINGS + MessageView.BINDINGS:
        name = binding.action.removeprefix("app.").split("(")[0]
        assert callable(ChatApp.__dict__.get(f"action_{name}")) or name == "quit", name
        assert binding.id.startswith("chat.")
