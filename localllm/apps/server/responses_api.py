"""POST /v1/responses, the Responses API: text or message input, streamed events, and
``previous_response_id``, whose conversation is kept so that the next turn's prompt starts
with it and is answered from the prefix cache; function tools give function_call items."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from localllm.text.tool_calls import ToolCall

from .common import (ServerState, StoredResponse, event_stream, logprob_items, new_id,
                     output_format, respond, sse)
from .errors import APIError
from .runs import Event, Failed, Finished, GenerationSpec, Piece, Prompt, Started, Usage
from .schemas import ResponsesRequest
from .tool_use import CallArgs, CallDone, CallStart, StreamSplitter, ToolPlan, plan

router = APIRouter()

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _state(request: Request) -> ServerState:
    return request.app.state.server


class _Turn:
    """One response being built: its identity, the request's settings, and its text."""

    def __init__(self, st: ServerState, body: ResponsesRequest, sampling: dict,
                 history: list[dict]):
        self.st = st
        self.tools: ToolPlan | None = None
        self.splitter: StreamSplitter | None = None
        self.content = ""     # the answer's text, its calls apart (once finished)
        self.calls: list = []
        self.call_ids: list[str] = []
        self.body = body
        self.sampling = sampling
        self.id = new_id("resp_")
        self.msg_id = new_id("msg_")
        self.rs_id = new_id("rs_")
        self.reasoning: list[str] = []
        self.effort = body.reasoning.effort if body.reasoning else None
        self.shown: list[str] = []     # streamed: the output items begun, in order
        self.created = int(time.time())
        self.input = history + body.input_messages()  # the conversation, without instructions
        self.logprobs = LOGPROBS_INCLUDE in (body.include or [])
        self.text: list[str] = []
        self.parts: list = []          # harmony messages to functions, split off the text
        self.lps: list = []
        self.finish: str | None = None
        self.usage = Usage()
        self.seq = 0

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.body.instructions}] \
            if self.body.instructions else []
        return system + self.input

    def add(self, ev: Event) -> None:
        if isinstance(ev, Piece):
            self.text.append(ev.text)
            self.parts += ev.tool_calls
            self.reasoning.append(ev.reasoning)
            self.lps += ev.logprobs or []
        elif isinstance(ev, Finished):
            self.finish = ev.finish_reason
            self.usage = ev.usage
            text = "".join(self.text)
            self.content, self.calls = (self.tools.split(text, self.parts) if self.tools
                                        else (text, []))

    # ---- the objects of the API -----------------------------------------------------

    def part(self) -> dict:
        text = self.content if self.finish is not None else "".join(self.text)
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": logprob_items(self.lps) if self.logprobs else []}

    def item(self, status: str) -> dict:
        content = [self.part()] if status != "in_progress" else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": content}

    def reasoning_item(self, status: str) -> dict:
        """The model's thinking as a reasoning output item (its text as reasoning_text)."""
        content = [{"type": "reasoning_text", "text": "".join(self.reasoning)}] \
            if status != "in_progress" else []
        return {"type": "reasoning", "id": self.rs_id, "status": status, "summary": [],
                "content": content}

    def call_item(self, i: int, status: str) -> dict:
        """Call i as a function_call output item (no arguments yet while in progress)."""
        c = self.calls[i]
        return {"type": "function_call", "id": self.call_id(i), "call_id": c.id,
                "name": c.name, "arguments": c.arguments if status != "in_progress" else "",
                "status": status}

    def call_id(self, i: int) -> str:
        """The output item id of call i (made when it is first asked for)."""
        while len(self.call_ids) <= i:
            self.call_ids.append(new_id("fc_"))
        return self.call_ids[i]

    def has_message(self) -> bool:
        """Whether the output has a message item (not for calls alone)."""
        return bool(self.content) or not self.calls or "message" in self.shown

    def outputs(self, status: str) -> list[dict]:
        items = [("reasoning", self.reasoning_item(status))] if "".join(self.reasoning) else []
        items += [("message", self.item(status))] if self.has_message() else []
        items += [(f"call{i}", self.call_item(i, status)) for i in range(len(self.calls))]
        # streamed, the items keep the order in which they began
        items.sort(key=lambda k: self.shown.index(k[0]) if k[0] in self.shown else len(items))
        return [item for _, item in items]

    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return "incomplete" if self.finish == "length" else "completed"

    def response(self) -> dict:
        b, s = self.body, self.sampling
        status = self.status()
        u = self.usage
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status != "in_progress" else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": self.st.served_name(b.model),
            "output": self.outputs("completed" if status == "completed" else "incomplete")
            if status != "in_progress" else [],
            "parallel_tool_calls": bool(b.tools) and b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": self.effort, "summary": None}, "store": b.store,
            "temperature": s.get("temperature"), "top_p": s.get("top_p"),
            "text": {"format": _format_echo(b)},
            "tool_choice": b.tool_choice or ("auto" if b.tools else "none"),
            "tools": [{"strict": None, "description": None, "parameters": None, **t}
                      for t in b.tools or ()], "truncation": "disabled",
            "metadata": b.metadata or {}, "user": None,
            "usage": {"input_tokens": u.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": u.cached_tokens},
                      "output_tokens": u.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                      "total_tokens": u.prompt_tokens + u.completion_tokens}
            if status != "in_progress" else None,
        }

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, event=kind)

    def store(self) -> None:
        if self.body.store and self.finish is not None:
            reply = {"role": "assistant", "content": self.content}
            if self.calls:
                reply["tool_calls"] = [c.as_openai() for c in self.calls]
            self.st.responses.put(self.id, StoredResponse(self.response(), self.input + [reply]))


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    """Create a response; with previous_response_id it continues that conversation."""
    st = _state(request)
    st.check_model(body.model)
    fmt = body.text.format if body.text else None
    output = output_format(fmt.type, fmt.schema_, "text.format") if fmt else None
    history: list[dict] = []
    if body.previous_response_id is not None:
        prev = st.responses.get(body.previous_response_id)
        if prev is None:
            raise APIError(400, f"previous response {body.previous_response_id!r} not found "
                                "(it was not stored, was deleted, or has aged out)",
                           "previous_response_not_found", "previous_response_id")
        history = prev.messages
    turn = _Turn(st, body, st.sampling(body, body.max_output_tokens, None), history)
    kwargs = {"reasoning_effort": turn.effort} if turn.effort else {}
    source = await st.scheduler.call(lambda m: m.template.source)
    tools = plan(source, turn.messages(), kwargs, body.chat_tools(), body.chat_tool_choice(),
                 body.parallel_tool_calls is not False)
    if tools.fmt is not None:
        turn.tools, turn.splitter = tools, StreamSplitter(tools)
    spec = GenerationSpec([Prompt(messages=tools.messages, param="input",
                                  template_kwargs=tools.template_kwargs)], turn.sampling,
                          logprobs=turn.logprobs,
                          top_logprobs=(body.top_logprobs or 0) if turn.logprobs else 0,
                          output=tools.output or output, split_reasoning=st.settings.reasoning_format != "none")
    job = st.scheduler.submit(spec)

    def whole(events: list[Event]) -> JSONResponse:
        for ev in events:
            turn.add(ev)
        turn.store()
        return JSONResponse(turn.response())

    def stream(first: Event):
        return event_stream(first, job, lambda ev: _render(turn, ev), lambda: [])
    return await respond(job, request, stream if body.stream else None, whole)


def _format_echo(body: ResponsesRequest) -> dict:
    """The response's ``text.format``: the request's, as OpenAI echoes it."""
    f = body.text.format if body.text else None
    if f is None or f.type != "json_schema":
        return {"type": f.type if f else "text"}
    return {"type": f.type, "name": f.name, "schema": f.schema_, "description": f.description,
            "strict": f.strict}


def _render(turn: _Turn, ev: Event) -> list[str]:
    """The Responses API's stream events for one job event. Output items begin when their
    first text does: the reasoning item (a reasoning model's thinking), then the message."""
    turn.add(ev)
    if isinstance(ev, Started):
        return [turn.event("response.created", response=turn.response()),
                turn.event("response.in_progress", response=turn.response())]
    if isinstance(ev, Piece):
        out = []
        if ev.reasoning and "message" not in turn.shown:
            if "reasoning" not in turn.shown:
                out += _begin(turn, "reasoning")
            out.append(turn.event("response.reasoning_text.delta", **_where(turn, "reasoning"),
                                  delta=ev.reasoning))
        text = turn.splitter.feed(ev.text, ev.tool_calls) if turn.splitter else ev.text
        if text or (ev.logprobs and not turn.splitter):
            out += _begin_message(turn)
            out.append(turn.event("response.output_text.delta", **_where(turn, "message"),
                                  delta=text,
                                  logprobs=logprob_items(ev.logprobs) if turn.logprobs else []))
        return out + (_call_events(turn, turn.splitter.take()) if turn.splitter else [])
    if isinstance(ev, Finished):
        rest, calls = turn.splitter.finish() if turn.splitter else ("", [])
        turn.calls = calls if turn.splitter else turn.calls   # with the ids their events had
        turn.store()
        out = _call_events(turn, turn.splitter.take()) if turn.splitter else []
        if rest:
            out += _begin_message(turn)
            out.append(turn.event("response.output_text.delta", **_where(turn, "message"),
                                  delta=rest, logprobs=[]))
        final = "response.completed" if turn.status() == "completed" else "response.incomplete"
        if turn.has_message():
            out += _begin_message(turn)   # a reply of thinking alone still has its message
            part = turn.part()
            where = _where(turn, "message")
            out += [turn.event("response.output_text.done", **where, text=part["text"],
                               logprobs=part["logprobs"]),
                    turn.event("response.content_part.done", **where, part=part),
                    turn.event("response.output_item.done", output_index=where["output_index"],
                               item=turn.item(turn.status()))]
        return out + [turn.event(final, response=turn.response())]
    if isinstance(ev, Failed):  # after the stream began: an error event ends it
        e = ev.error.body()["error"]
        return [turn.event("error", code=e["code"], message=e["message"], param=e["param"])]
    return []


def _call_events(turn: _Turn, events: list) -> list[str]:
    """The events of function_call items from a StreamSplitter's call events: the item added
    when its name is known, its arguments in deltas, then done."""
    out = []
    for ev in events:
        if isinstance(ev, CallStart):
            turn.shown.append(f"call{ev.index}")
            if ev.index >= len(turn.calls):
                turn.calls.append(ToolCall(ev.name, "", ev.id))
        at = {"item_id": turn.call_id(ev.index),
              "output_index": turn.shown.index(f"call{ev.index}")}
        if isinstance(ev, CallStart):
            out.append(turn.event("response.output_item.added", output_index=at["output_index"],
                                  item=turn.call_item(ev.index, "in_progress")))
        elif isinstance(ev, CallArgs):
            out.append(turn.event("response.function_call_arguments.delta", **at,
                                  delta=ev.fragment))
        elif isinstance(ev, CallDone):
            turn.calls[ev.index] = ev.call
            out += [turn.event("response.function_call_arguments.done", **at,
                               arguments=ev.call.arguments),
                    turn.event("response.output_item.done", output_index=at["output_index"],
                               item=turn.call_item(ev.index, "completed"))]
    return out


def _where(turn: _Turn, kind: str) -> dict:
    item = turn.rs_id if kind == "reasoning" else turn.msg_id
    return {"item_id": item, "output_index": turn.shown.index(kind), "content_index": 0}


def _begin(turn: _Turn, kind: str) -> list[str]:
    """Events that add an output item and its (empty) content part."""
    turn.shown.append(kind)
    if kind == "reasoning":
        item, part = turn.reasoning_item("in_progress"), {"type": "reasoning_text", "text": ""}
    else:
        item = turn.item("in_progress")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    where = _where(turn, kind)
    return [turn.event("response.output_item.added", output_index=where["output_index"],
                       item=item),
            turn.event("response.content_part.added", **where, part=part)]


def _begin_message(turn: _Turn) -> list[str]:
    """The message item's start, once; the reasoning item before it is ended first."""
    if "message" in turn.shown:
        return []
    out = []
    if "reasoning" in turn.shown:
        where, text = _where(turn, "reasoning"), "".join(turn.reasoning)
        part = {"type": "reasoning_text", "text": text}
        out += [turn.event("response.reasoning_text.done", **where, text=text),
                turn.event("response.content_part.done", **where, part=part),
                turn.event("response.output_item.done", output_index=where["output_index"],
                           item=turn.reasoning_item("completed"))]
    return out + _begin(turn, "message")


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    """A stored response."""
    item = _state(request).responses.get(response_id)
    if item is None:
        raise APIError(404, f"no response {response_id!r}", "not_found", "response_id")
    return JSONResponse(item.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    """Forget a stored response (its conversation can no longer be continued)."""
    if not _state(request).responses.delete(response_id):
        raise APIError(404, f"no response {response_id!r}", "not_found", "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
