"""POST /v1/responses, the Responses API: text or message input, streamed events, and
``previous_response_id``, whose conversation is kept so that the next turn's prompt starts
with it and is answered from the prefix cache."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from .common import (ServerState, StoredResponse, event_stream, logprob_items, new_id,
                     output_format, respond, sse)
from .errors import APIError
from .runs import Event, Failed, Finished, GenerationSpec, Piece, Prompt, Started, Usage
from .schemas import ResponsesRequest

router = APIRouter()

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _state(request: Request) -> ServerState:
    return request.app.state.server


class _Turn:
    """One response being built: its identity, the request's settings, and its text."""

    def __init__(self, st: ServerState, body: ResponsesRequest, sampling: dict,
                 history: list[dict]):
        self.st = st
        self.body = body
        self.sampling = sampling
        self.id = new_id("resp_")
        self.msg_id = new_id("msg_")
        self.created = int(time.time())
        self.input = history + body.input_messages()  # the conversation, without instructions
        self.logprobs = LOGPROBS_INCLUDE in (body.include or [])
        self.text: list[str] = []
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
            self.lps += ev.logprobs or []
        elif isinstance(ev, Finished):
            self.finish = ev.finish_reason
            self.usage = ev.usage

    # ---- the objects of the API -----------------------------------------------------

    def part(self) -> dict:
        return {"type": "output_text", "text": "".join(self.text), "annotations": [],
                "logprobs": logprob_items(self.lps) if self.logprobs else []}

    def item(self, status: str) -> dict:
        content = [self.part()] if status != "in_progress" else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": content}

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
            "output": [self.item("completed" if status == "completed" else "incomplete")]
            if status != "in_progress" else [],
            "parallel_tool_calls": False, "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": b.store,
            "temperature": s.get("temperature"), "top_p": s.get("top_p"),
            "text": {"format": _format_echo(b)},
            "tool_choice": "none", "tools": [], "truncation": "disabled",
            "metadata": b.metadata or {}, "user": None,
            "usage": {"input_tokens": u.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": u.cached_tokens},
                      "output_tokens": u.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": u.prompt_tokens + u.completion_tokens}
            if status != "in_progress" else None,
        }

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(data, event=kind)

    def store(self) -> None:
        if self.body.store and self.finish is not None:
            reply = {"role": "assistant", "content": "".join(self.text)}
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
    spec = GenerationSpec([Prompt(messages=turn.messages(), param="input")], turn.sampling,
                          logprobs=turn.logprobs,
                          top_logprobs=(body.top_logprobs or 0) if turn.logprobs else 0,
                          output=output)
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
    """The Responses API's stream events for one job event."""
    turn.add(ev)
    where = {"item_id": turn.msg_id, "output_index": 0, "content_index": 0}
    if isinstance(ev, Started):
        empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [turn.event("response.created", response=turn.response()),
                turn.event("response.in_progress", response=turn.response()),
                turn.event("response.output_item.added", output_index=0,
                           item=turn.item("in_progress")),
                turn.event("response.content_part.added", **where, part=empty)]
    if isinstance(ev, Piece):
        if not ev.text and not ev.logprobs:
            return []
        return [turn.event("response.output_text.delta", **where, delta=ev.text,
                           logprobs=logprob_items(ev.logprobs) if turn.logprobs else [])]
    if isinstance(ev, Finished):
        turn.store()
        part = turn.part()
        final = "response.completed" if turn.status() == "completed" else "response.incomplete"
        return [turn.event("response.output_text.done", **where, text=part["text"],
                           logprobs=part["logprobs"]),
                turn.event("response.content_part.done", **where, part=part),
                turn.event("response.output_item.done", output_index=0,
                           item=turn.item(turn.status())),
                turn.event(final, response=turn.response())]
    if isinstance(ev, Failed):  # after the stream began: an error event ends it
        e = ev.error.body()["error"]
        return [turn.event("error", code=e["code"], message=e["message"], param=e["param"])]
    return []


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
