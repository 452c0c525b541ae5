"""Reasoning apart from the answer on /v1/chat/completions: a real server process with SmolLM2
under a template that opens <think> itself, and one in harmony's shape. Earlier answers in
the conversation show the pattern, which the model, greedy, follows."""

from __future__ import annotations

from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from localllm.testing.server_process import ServerProcess  # noqa: E402
from support.tools import SHOTS  # noqa: E402

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"


def conversation(question: str = "What is 5+5?") -> list[dict]:
    msgs = []
    for q, r, a in SHOTS:
        msgs += [{"role": "user", "content": q},
                 {"role": "assistant", "content": a, "reasoning_content": r}]
    return msgs + [{"role": "user", "content": question}]


def serve(path, template: str, *args: str):
    s = ServerProcess(path, "-c", "1024", "--chat-template", str(TEMPLATES / template),
                      "--temp", "0", *args)
    s.wait_ready()
    return s


@pytest.fixture(scope="module")
def think(smollm_path):
    s = serve(smollm_path, "think-open.jinja")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def harmony(smollm_path):
    s = serve(smollm_path, "harmony.jinja")
    yield s
    s.stop()


def client_of(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


def ask(server, stream: bool = False, **kw):
    c = client_of(server)
    body = dict(model="smollm2-135m", messages=conversation(), **{"max_tokens": 40, **kw})
    if not stream:
        return c.chat.completions.create(**body)
    reasoning, content, finish = [], [], None
    for chunk in c.chat.completions.create(stream=True, **body):
        d = chunk.choices[0].delta
        reasoning.append(getattr(d, "reasoning_content", None) or "")
        content.append(d.content or "")
        finish = chunk.choices[0].finish_reason or finish
        # a chunk carries one or the other, never both
        assert not (getattr(d, "reasoning_content", None) and d.content)
    return "".join(reasoning), "".join(content), finish


def test_think_split_whole(think):
    r = ask(think)
    msg = r.choices[0].message
    assert msg.reasoning_content == "Five plus five is eight."
    assert msg.content == "8"
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens


def test_think_split_streamed_matches_whole(think):
    assert ask(think, stream=True) == ("Five plus five is eight.", "8", "stop")


def test_reasoning_format_none_leaves_the_text(think):
    r = ask(think, extra_body={"reasoning_format": "none"})
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    assert msg.content == "Five plus five is eight.\n</think>\n\n8"
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_template_kwargs_reach_the_template(think):
    # enable_thinking=false: the template closes the block empty, so all of it is content
    r = ask(think, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert r.choices[0].message.content
    # reasoning_effort is a template variable too: this template states it in a system line
    plain = ask(think, max_tokens=1).usage.prompt_tokens
    high = ask(think, max_tokens=1, reasoning_effort="high").usage.prompt_tokens
    assert high > plain


def test_bad_reasoning_fields_are_refused(think):
    c = client_of(think)
    with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
        c.chat.completions.create(model="smollm2-135m", messages=conversation(),
                                  extra_body={"chat_template_kwargs":
                                              {"add_generation_prompt": False}})
    with pytest.raises(openai.BadRequestError, match="reasoning_format"):
        c.chat.completions.create(model="smollm2-135m", messages=conversation(),
                                  extra_body={"reasoning_format": "xml"})


STOP = ["<|end|><|start|>user"]   # where gpt-oss itself would end with <|return|>


def test_harmony_split_whole_and_streamed(harmony):
    r = ask(harmony, stop=STOP, max_tokens=64)
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Five plus five is ten.", "10")
    assert r.choices[0].finish_reason == "stop"
    assert ask(harmony, stream=True, stop=STOP, max_tokens=64) == (
        "Five plus five is ten.", "10", "stop")


# ----------------------------------------------------------------------------- responses

def test_responses_reasoning_item_whole_and_streamed(think):
    c = client_of(think)
    # asked alone, greedy SmolLM2 answers inside the block the template opened, and ends
    r = c.responses.create(model="smollm2-135m", input="What is 5+5?", max_output_tokens=30,
                           reasoning={"effort": "low"})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thought = r.output[0].content[0].text
    assert thought.startswith("The answer is") and r.output_text == ""
    assert r.reasoning.effort == "low"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    events = list(c.responses.create(model="smollm2-135m", input="What is 5+5?",
                                     max_output_tokens=30, reasoning={"effort": "low"},
                                     stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == thought
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type) for e in done] == [(0, "reasoning"), (1, "message")]
    assert kinds[-1] == "response.completed"
    assert [o.type for o in events[-1].response.output] == ["reasoning", "message"]
    assert [e.sequence_number for e in events] == list(range(len(events)))


# ----------------------------------------------------------------------------- SmolLM3

@pytest.fixture(scope="module")
def smollm3(smollm_path):
    s = serve(smollm_path, "smollm3.jinja")
    yield s
    s.stop()


def smollm3_conversation(flag: str) -> list[dict]:
    """SmolLM3's template drops reasoning_content from earlier answers (as its own does):
    with /think their thinking is written in the content, where the model sees it."""
    msgs = [{"role": "system", "content": f"Answer with a number. {flag}"}]
    for q, r, a in SHOTS:
        msgs += [{"role": "user", "content": q},
                 {"role": "assistant",
                  "content": f"<think>\n{r}\n</think>\n{a}" if flag == "/think" else a}]
    return msgs + [{"role": "user", "content": "What is 5+5?"}]


@pytest.mark.parametrize("flag", ["/think", "/no_think"])
def test_smollm3_template_think_and_no_think(smollm3, flag):
    c = client_of(smollm3)
    r = c.chat.completions.create(model="smollm2-135m", max_tokens=40,
                                  messages=smollm3_conversation(flag))
    msg = r.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    print(flag, repr(reasoning), repr(msg.content))
    if flag == "/think":
        assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
        assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    else:   # the template closed the block: the whole output is the answer
        assert reasoning is None
        assert r.usage.completion_tokens_details.reasoning_tokens == 0
    assert msg.content and "think>" not in msg.content
