"""llama.cpp's request fields and server flags as the real openai client sends them: n_probs
on /v1/completions and chat completions, and `llm serve --reasoning-format none`."""

from __future__ import annotations

from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from localllm.testing.server_process import ServerProcess  # noqa: E402
from support.tools import SHOTS  # noqa: E402

M = "smollm2-135m"
TEMPLATE = Path(__file__).parents[1] / "fixtures" / "templates" / "think-open.jinja"


def test_n_probs_asks_for_top_logprobs_on_completions(tool_client):
    kw = dict(model=M, prompt="The capital of France is", max_tokens=4, temperature=0)
    plain = tool_client.completions.create(**kw)
    assert plain.choices[0].logprobs is None
    r = tool_client.completions.create(extra_body={"n_probs": 3}, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert all(t <= 0 for t in lp.token_logprobs)
    # an explicit logprobs wins over n_probs
    r = tool_client.completions.create(logprobs=1, extra_body={"n_probs": 3}, **kw)
    assert all(len(top) == 1 for top in r.choices[0].logprobs.top_logprobs)


def test_n_probs_is_the_chat_top_logprobs_when_asked_for_logprobs(tool_client):
    kw = dict(model=M, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
              temperature=0)
    r = tool_client.chat.completions.create(logprobs=True, extra_body={"n_probs": 2}, **kw)
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)
    r = tool_client.chat.completions.create(extra_body={"n_probs": 2}, **kw)
    assert r.choices[0].logprobs is None


@pytest.fixture(scope="module")
def raw_reasoning(smollm_path):
    s = ServerProcess(smollm_path, "-c", "1024", "--chat-template", str(TEMPLATE), "--temp", "0",
                      "--reasoning-format", "none")
    s.wait_ready()
    yield s
    s.stop()


def test_reasoning_format_none_flag_keeps_reasoning_in_content(raw_reasoning):
    msgs = []
    for q, r, a in SHOTS:
        msgs += [{"role": "user", "content": q},
                 {"role": "assistant", "content": a, "reasoning_content": r}]
    msgs.append({"role": "user", "content": "What is 5+5?"})
    c = openai.OpenAI(base_url=raw_reasoning.url + "/v1", api_key="x", max_retries=0,
                      timeout=120)
    m = c.chat.completions.create(model=M, messages=msgs, max_tokens=40).choices[0].message
    assert getattr(m, "reasoning_content", None) is None
    assert m.content == "Five plus five is eight.\n</think>\n\n8"
    streamed = [ch.choices[0].delta for ch in c.chat.completions.create(
        model=M, messages=msgs, max_tokens=40, stream=True)]
    assert not any(getattr(d, "reasoning_content", None) for d in streamed)
    assert "".join(d.content or "" for d in streamed) == m.content
    # the request's own reasoning_format still splits it
    m = c.chat.completions.create(model=M, messages=msgs, max_tokens=40,
                                  extra_body={"reasoning_format": "auto"}).choices[0].message
    assert m.reasoning_content == "Five plus five is eight." and m.content == "8"
    c.close()
