"""POST /v1/chat/completions and /v1/completions, streamed as server-sent events or whole."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from .common import (ServerState, constrained_output, event_stream, logprob_items, new_id,
                     respond, sse, total_usage, usage_body)
from .runs import Event, Finished, GenerationSpec, Piece, Prompt, Started
from .schemas import ChatCompletionRequest, CompletionRequest
from .tool_use import StreamSplitter, ToolPlan, call_deltas, plan

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _include_usage(body) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


class _Choices:
    """Text, logprobs and finish reason of each choice, gathered from events."""

    def __init__(self, events: list[Event]):
        self.text: dict[int, list[str]] = {}     # the echoed prompt first (or "")
        self.reasoning: dict[int, list[str]] = {}
        self.logprobs: dict[int, list] = {}
        self.calls: dict[int, list] = {}         # harmony messages to functions (Parts)
        self.finish: dict[int, str] = {}
        for ev in events:
            if isinstance(ev, Started):
                self.text[ev.index] = [ev.prompt_text or ""]
                self.reasoning[ev.index] = []
                self.logprobs[ev.index] = list(ev.prompt_logprobs or [])
                self.calls[ev.index] = []
            elif isinstance(ev, Piece):
                self.text[ev.index].append(ev.text)
                self.reasoning[ev.index].append(ev.reasoning)
                self.logprobs[ev.index] += ev.logprobs or []
                self.calls[ev.index] += ev.tool_calls
            elif isinstance(ev, Finished):
                self.finish[ev.index] = ev.finish_reason

    def indexes(self) -> list[int]:
        return sorted(self.text)

    def message(self, i: int, tools: ToolPlan | None = None) -> dict:
        """The assistant message of choice i (its reasoning apart, where there was some, and
        its tool calls, where the request had tools)."""
        m = {"role": "assistant", "content": "".join(self.text[i]), "refusal": None}
        if tools is not None:
            content, calls = tools.split(m["content"], self.calls.get(i, ()))
            m["content"] = content or None if calls else content
            if calls:
                m["tool_calls"] = [c.as_openai() for c in calls]
                if self.finish.get(i) == "stop":
                    self.finish[i] = "tool_calls"
        reasoning = "".join(self.reasoning[i])
        if reasoning:
            m["reasoning_content"] = reasoning
        return m


def split_reasoning(st: ServerState, requested: str | None) -> bool:
    """Whether a chat request gets its reasoning apart (--reasoning-format, or the request's
    reasoning_format)."""
    return (requested or st.settings.reasoning_format) != "none"


# ----------------------------------------------------------------------------- chat

@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    """Chat completions, as OpenAI's API defines them."""
    st = _state(request)
    st.check_model(body.model)
    st.check_n(body.n)
    output = constrained_output(body)
    sampling = st.sampling(body, body.max_completion_tokens or body.max_tokens, body.stop)
    messages = [m.as_template_message() for m in body.messages]
    top = body.top_logprobs if body.top_logprobs is not None else (body.n_probs or 0)
    source = await st.scheduler.call(lambda m: m.template.source)
    tools = plan(source, messages, body.template_kwargs(), body.tools, body.tool_choice,
                 body.parallel_tool_calls)
    output = tools.output or output
    spec = GenerationSpec([Prompt(messages=tools.messages, template_kwargs=tools.template_kwargs)],
                          sampling, n=body.n, logprobs=body.logprobs,
                          top_logprobs=top if body.logprobs else 0, output=output,
                          split_reasoning=split_reasoning(st, body.reasoning_format))
    job = st.scheduler.submit(spec)
    head = {"id": new_id("chatcmpl-"), "created": int(time.time()),
            "model": st.served_name(body.model),
            "system_fingerprint": st.fingerprint}

    def whole(events: list[Event]) -> JSONResponse:
        got = _Choices(events)
        choices = [{"index": i,
                    "message": got.message(i, tools),
                    "logprobs": ({"content": logprob_items(got.logprobs[i]), "refusal": None}
                                 if body.logprobs else None),
                    "finish_reason": got.finish.get(i, "length")} for i in got.indexes()]
        return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                             "usage": usage_body(total_usage(events, body.n))})

    def stream(first: Event):
        return _chat_stream(first, job, head, body.n, body.logprobs, _include_usage(body),
                            tools if tools.fmt is not None else None)
    return await respond(job, request, stream if body.stream else None, whole)


def _chat_stream(first: Event, job, head: dict, n: int, logprobs: bool, include_usage: bool,
                 tools: ToolPlan | None = None):
    events: list[Event] = []
    splitters: dict[int, StreamSplitter] = {}
    base = {**head, "object": "chat.completion.chunk"}
    if include_usage:
        base["usage"] = None

    def chunk(index: int, delta: dict, finish=None, lps=None) -> str:
        lp = {"content": logprob_items(lps), "refusal": None} if logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse({**base, "choices": [choice]})

    def render(ev: Event) -> list[str]:
        events.append(ev)
        if isinstance(ev, Started):
            return [chunk(ev.index, {"role": "assistant", "content": ""})]
        if isinstance(ev, Piece):
            out = [chunk(ev.index, {"reasoning_content": ev.reasoning})] if ev.reasoning else []
            text, calls = ev.text, []
            if tools is not None:
                split = splitters.setdefault(ev.index, StreamSplitter(tools))
                text, calls = split.feed(ev.text, ev.tool_calls), split.take()
            if text or ev.logprobs:
                out.append(chunk(ev.index, {"content": text}, lps=ev.logprobs))
            return out + [chunk(ev.index, d) for d in call_deltas(calls)]
        if isinstance(ev, Finished):
            out, finish = [], ev.finish_reason
            if tools is not None:
                split = splitters.setdefault(ev.index, StreamSplitter(tools))
                rest, calls = split.finish()
                if rest:
                    out.append(chunk(ev.index, {"content": rest}))
                out += [chunk(ev.index, d) for d in call_deltas(split.take())]
                if calls and finish == "stop":
                    finish = "tool_calls"
            return out + [chunk(ev.index, {}, finish)]
        return []

    return event_stream(first, job, render, lambda: _closing(base, events, n, include_usage))


# ----------------------------------------------------------------------------- completions

def _legacy_logprobs(lps, offset: int) -> dict:
    """The completions API's logprobs: parallel lists of tokens, their log-probabilities and
    their character offsets in the choice's text. The sampled token is always among its
    position's top_logprobs (as OpenAI's are); an echoed prompt's first token has none."""
    tokens, values, offsets, tops = [], [], [], []
    for t in lps:
        tokens.append(t.token)
        values.append(t.logprob)
        offsets.append(offset)
        top = {a.token: a.logprob for a in t.top}
        if t.logprob is not None:
            top.setdefault(t.token, t.logprob)
        tops.append(top if t.logprob is not None else None)
        offset += len(t.token)
    return {"tokens": tokens, "token_logprobs": values,
            "top_logprobs": tops if any(tops) else None, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    """Text completions (the prompt continued as it is, no chat template)."""
    st = _state(request)
    st.check_model(body.model)
    prompts = body.prompts()
    st.check_n(body.n * len(prompts))
    sampling = st.sampling(body, body.max_tokens, body.stop)
    n_lps = body.logprobs if body.logprobs is not None else body.n_probs
    if body.suffix is not None:  # fill in the middle, as /infill builds it
        suffix, n_predict = body.suffix, body.max_tokens or -1
        prompts = await st.scheduler.call(lambda m: [
            m.infill_tokens(p, suffix, n_predict=n_predict) for p in prompts])
    spec = GenerationSpec([Prompt(text=p, param="prompt") if isinstance(p, str)
                           else Prompt(ids=p, param="prompt") for p in prompts],
                          sampling, n=body.n, logprobs=n_lps is not None,
                          top_logprobs=n_lps or 0, echo=body.echo,
                          output=constrained_output(body))
    job = st.scheduler.submit(spec)
    head = {"id": new_id("cmpl-"), "object": "text_completion", "created": int(time.time()),
            "model": st.served_name(body.model), "system_fingerprint": st.fingerprint}
    want_lps = n_lps is not None

    def whole(events: list[Event]) -> JSONResponse:
        got = _Choices(events)
        choices = []
        for i in got.indexes():
            echo = got.text[i][0]
            choices.append({"index": i, "text": "".join(got.text[i]),
                            "logprobs": _legacy_logprobs(
                                got.logprobs[i], 0 if body.echo else len(echo))
                            if want_lps else None,
                            "finish_reason": got.finish.get(i, "length")})
        return JSONResponse({**head, "choices": choices,
                             "usage": usage_body(total_usage(events, body.n))})

    def stream(first: Event):
        return _completion_stream(first, job, head, body.n, want_lps, _include_usage(body))
    return await respond(job, request, stream if body.stream else None, whole)


def _completion_stream(first: Event, job, head: dict, n: int, logprobs: bool,
                       include_usage: bool):
    events: list[Event] = []
    offsets: dict[int, int] = {}
    base = {**head, "usage": None} if include_usage else dict(head)

    def chunk(index: int, text: str, finish=None, lps=None) -> str:
        lp = None
        if logprobs:
            lp = _legacy_logprobs(lps or [], offsets.get(index, 0))
        offsets[index] = offsets.get(index, 0) + len(text)
        return sse({**base, "choices": [{"index": index, "text": text, "logprobs": lp,
                                         "finish_reason": finish}]})

    def render(ev: Event) -> list[str]:
        events.append(ev)
        if isinstance(ev, Started):
            return [chunk(ev.index, ev.prompt_text, lps=ev.prompt_logprobs)] \
                if ev.prompt_text else []
        if isinstance(ev, Piece):
            return [chunk(ev.index, ev.text, lps=ev.logprobs)] if ev.text or ev.logprobs else []
        if isinstance(ev, Finished):
            return [chunk(ev.index, "", ev.finish_reason)]
        return []

    return event_stream(first, job, render, lambda: _closing(base, events, n, include_usage))


def _closing(base: dict, events: list[Event], n: int, include_usage: bool) -> list[str]:
    """After the last choice: the usage chunk if asked for, then [DONE]."""
    out = []
    if include_usage:
        out.append(sse({**base, "choices": [], "usage": usage_body(total_usage(events, n))}))
    return out + [sse("[DONE]")]
