"""`llm chat` with a model that reasons (SmolLM2 under a template that opens <think>, the
real app under textual's Pilot): the thinking is shown folded to one line, opens and folds
with a key, is kept apart from the answer and comes back with the stored conversation."""

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("textual", reason="llm chat needs the chat extra (textual)")

from localllm.apps.tui.app import ChatApp, ChatOptions  # noqa: E402
from localllm.apps.tui.pilot import say, until  # noqa: E402
from localllm.apps.tui.widgets import MessageView  # noqa: E402

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "templates" / "think-open.jinja"


@pytest.fixture(scope="module")
def model(smollm_path):
    import localllm
    m = localllm.load(smollm_path, ctx_size=1024, chat_template=str(TEMPLATE))
    yield m
    m.close()


def make_app(model, tmp_path):
    sampling = dict(temperature=0.0, max_tokens=30, top_k=40, top_p=0.95, min_p=0.05,
                    repeat_penalty=1.0, seed=None)
    return ChatApp(ChatOptions(load=lambda: model, model_label="smollm2-135m",
                               database=tmp_path / "chat.db", clipboard=tmp_path / "clip.txt",
                               sampling=sampling))


def drive(app, script):
    async def main():
        async with app.run_test(size=(100, 40)) as pilot:
            await until(pilot, lambda: app.chat_model is not None)
            await script(pilot)
    asyncio.run(main())


def thinking_line(view: MessageView) -> str:
    return str(view.thinking.render())


def test_thinking_is_folded_and_opens_with_a_key(model, tmp_path):
    app = make_app(model, tmp_path)
    seen = {}

    async def script(pilot):
        await say(pilot, "What is 5+5?")
        reply = app.chat_view.message_views()[-1]
        assert reply.role == "assistant"
        # greedy, the model answers inside the block the template opened, and ends there
        assert reply.reasoning == "The answer is 15."
        assert reply.text == ""
        assert reply.thinking.display
        folded = thinking_line(reply)
        assert folded.startswith("▸ Thought for ") and folded.endswith(" tokens")
        assert int(folded.split()[3]) == reply.reasoning_tokens > 0
        assert "15" not in folded
        reply.focus()
        await pilot.press("t")
        assert thinking_line(reply) == f"▾ Thought for {reply.reasoning_tokens} tokens\n" \
                                       "The answer is 15."
        await pilot.press("t")
        assert thinking_line(reply) == folded
        seen["meta"] = reply.message.meta
        seen["content"] = reply.message.content
        seen["conv"] = app.conv.id
    drive(app, script)
    # stored apart from the answer, with its token count
    assert seen["content"] == ""
    assert seen["meta"]["reasoning"] == "The answer is 15."
    assert seen["meta"]["reasoning_tokens"] > 0

    again = ChatApp(ChatOptions(load=lambda: model, model_label="smollm2-135m",
                                database=tmp_path / "chat.db", clipboard=tmp_path / "clip.txt",
                                sampling=dict(temperature=0.0, max_tokens=8),
                                resume=seen["conv"]))

    async def reopened(pilot):
        reply = again.chat_view.message_views()[-1]
        assert reply.reasoning == "The answer is 15."
        assert thinking_line(reply).startswith("▸ Thought for ")
    drive(again, reopened)


def test_a_model_without_thinking_shows_no_thinking_line(smollm_model, tmp_path):
    app = make_app(smollm_model, tmp_path)

    async def script(pilot):
        await say(pilot, "Hello!")
        reply = app.chat_view.message_views()[-1]
        assert reply.text and not reply.reasoning
        assert not reply.thinking.display
    drive(app, script)
