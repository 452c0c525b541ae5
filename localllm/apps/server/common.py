"""What the endpoints share: the server's state, sampling settings from a request, waiting on a
job while watching for the client leaving, and server-sent events."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from localllm.generation.sampling import SamplingParams
from .errors import APIError, request_error
from .metrics import Metrics
from .runs import Done, Event, Failed, Finished, OutputFormat, TokenLogprob, Usage
from .scheduler import Job, Scheduler
from .schemas import SamplingFields
from .settings import ServerSettings

DISCONNECT_POLL_S = 0.25


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass
class StoredResponse:
    """A Responses API result and the conversation it ends (for previous_response_id)."""
    body: dict
    messages: list[dict]


class ResponseStore:
    """The latest responses, oldest dropped first; used on the event loop only."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, item: StoredResponse) -> None:
        self._items[rid] = item
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        return self._items.get(rid)

    def delete(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None


@dataclass
class ServerState:
    """Everything the endpoints need, built once at start."""
    settings: ServerSettings
    scheduler: Scheduler
    metrics: Metrics
    responses: ResponseStore
    model_names: frozenset[str]
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint: str = ""

    @property
    def model_id(self) -> str:
        return self.settings.model_id

    def listed_names(self) -> list[str]:
        """What /v1/models lists: the model's name, then its --alias names."""
        return list(dict.fromkeys([self.model_id, *self.settings.aliases]))

    def served_name(self, name: str | None) -> str:
        """The ``model`` an answer reports: the name asked for (any, unless --strict-model),
        else the model's own."""
        return name or self.model_id

    def check_model(self, name: str | None) -> None:
        """With --strict-model, 404 for a name this server does not have; otherwise any name
        is served by the one model (no name: the one it has)."""
        if not self.settings.strict_model:
            return
        if name is not None and name not in self.model_names:
            raise APIError(404, f"the model {name!r} does not exist; this server has "
                                f"{self.model_id!r}", "model_not_found", "model")

    def check_n(self, n: int) -> None:
        if n > self.settings.max_n:
            raise APIError(400, f"n: at most {self.settings.max_n} choices per request "
                                f"(got {n})", "invalid_value", "n")

    def sampling(self, req: SamplingFields, max_tokens: int | None,
                 stop: list[str] | None) -> dict:
        """The engine's sampling settings: the request's fields over the server's defaults.

        Raises:
            APIError: 400 for a combination the engine refuses.
        """
        s = dict(self.settings.sampling)
        given = {"temperature": req.temperature, "top_p": req.top_p, "min_p": req.min_p,
                 "repeat_penalty": req.repeat_penalty, "presence_penalty": req.presence_penalty,
                 "frequency_penalty": req.frequency_penalty, "max_tokens": max_tokens,
                 "repeat_last_n": req.repeat_last_n,
                 "stop": stop}
        s.update({k: v for k, v in given.items() if v is not None})
        if req.top_k is not None:
            s["top_k"] = max(req.top_k, 0)   # -1 and 0 both mean off
        if req.seed is not None:
            s["seed"] = None if req.seed == -1 else req.seed
        if req.logit_bias:
            s["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
        s["ignore_eos"] = req.ignore_eos or s.get("ignore_eos", False)
        try:
            SamplingParams(**s).validate()
        except ValueError as e:   # BadSetting, by the table
            raise request_error(e) from None
        return s


def constrained_output(body) -> OutputFormat | None:
    """The output format of a chat or completions request: llama.cpp's ``grammar`` (GBNF) or
    ``json_schema``, or ``response_format`` (OpenAI's shape or llama.cpp's).

    Raises:
        APIError: 400 when more than one of them is given.
    """
    fmt = getattr(body, "response_format", None)
    given = [k for k, v in (("grammar", body.grammar), ("json_schema", body.json_schema),
                            ("response_format", fmt if fmt and fmt.type != "text" else None))
             if v is not None]
    if len(given) > 1:
        raise APIError(400, f"give one of grammar, json_schema and response_format (got "
                            f"{', '.join(given)})", "invalid_request_error", given[1])
    if body.grammar is not None:
        return OutputFormat("grammar", None, "grammar", grammar=body.grammar)
    if body.json_schema is not None:
        return OutputFormat("json_schema", body.json_schema, "json_schema")
    if fmt is None:
        return None
    schema = fmt.schema()
    if fmt.type == "json_object" and schema is not None:   # llama.cpp's shape
        return OutputFormat("json_schema", schema, "response_format")
    return output_format(fmt.type, schema, "response_format")


def output_format(kind: str, schema: dict | None, param: str) -> OutputFormat | None:
    """JSON output asked for by a request, or None for plain text. Sampling is constrained
    by the format's grammar, so the output parses (and matches the schema) whatever the
    model would rather write."""
    if kind == "text":
        return None
    return OutputFormat(kind, schema if kind == "json_schema" else None, param)


# ----------------------------------------------------------------------------- waiting

async def next_event(job: Job, request: Request) -> Event | None:
    """The job's next event, or None (and the job cancelled) if the client disconnects
    while waiting (a queued or long prompt-processing request must not outlive its client)."""
    getter = asyncio.ensure_future(job.next_event())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if done:
                return getter.result()
            if await request.is_disconnected():
                job.cancel()
                return None
    finally:
        if not getter.done():
            getter.cancel()


async def collect(job: Job, request: Request) -> list[Event] | None:
    """All of a job's events up to Done (None if the client left).

    Raises:
        APIError: the job failed.
    """
    events: list[Event] = []
    while True:
        ev = await next_event(job, request)
        if ev is None:
            return None
        if isinstance(ev, Failed):
            raise ev.error
        events.append(ev)
        if isinstance(ev, Done):
            return events


async def first_event(job: Job, request: Request) -> Event | None:
    """The first event of a streaming job; a failure before any output is raised, so that
    it gets its honest status code instead of a 200 stream."""
    ev = await next_event(job, request)
    if isinstance(ev, Failed):
        raise ev.error
    return ev


async def respond(job: Job, request: Request, stream: Callable[[Event], Response] | None,
                  whole: Callable[[list[Event]], Response]) -> Response:
    """Answer a job: as a stream built from its first event, or whole from all its events.
    A client that left meanwhile gets nothing (its job is cancelled)."""
    gone = Response(status_code=499)   # nobody reads it; it ends the request quietly
    if stream is not None:
        first = await first_event(job, request)
        return gone if first is None else stream(first)
    events = await collect(job, request)
    return gone if events is None else whole(events)


def total_usage(events: list[Event], n: int) -> Usage:
    """A request's usage: each prompt counted once (n choices share it), every choice's
    completion counted."""
    u = Usage()
    for ev in events:
        if isinstance(ev, Finished):
            if ev.index % n == 0:
                u.prompt_tokens += ev.usage.prompt_tokens
                u.cached_tokens += ev.usage.cached_tokens
            u.completion_tokens += ev.usage.completion_tokens
            u.reasoning_tokens += ev.usage.reasoning_tokens
    return u


def usage_body(u: Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}


def logprob_items(lps: list[TokenLogprob] | None) -> list[dict]:
    """OpenAI's per-token logprob objects, each with its most likely alternatives."""
    return [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes,
             "top_logprobs": [{"token": a.token, "logprob": a.logprob, "bytes": a.bytes}
                              for a in t.top]}
            for t in lps or ()]


# ----------------------------------------------------------------------------- events out

def sse(data, event: str | None = None) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {text}\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that cancels its job the moment the client disconnects
    (whatever the ASGI server's version), rather than at the next write."""

    def __init__(self, content: AsyncIterator[str], on_disconnect: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send):
        async with anyio.create_task_group() as tg:
            async def stream():
                try:
                    await self.stream_response(send)
                except OSError:
                    self.on_disconnect()
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self._watch(receive)
            self.on_disconnect()
            tg.cancel_scope.cancel()

    @staticmethod
    async def _watch(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


def event_stream(first: Event, job: Job, render: Callable[[Event], list[str]],
                 closing: Callable[[], list[str]]) -> EventStream:
    """Stream a job's events as SSE text.

    Args:
        first: the event already taken (see first_event).
        job: the job; cancelled if the client leaves before Done.
        render: the SSE strings for one event.
        closing: the strings sent after Done (usage, [DONE]).
    """
    async def body():
        ev = first
        while True:
            if isinstance(ev, Failed):  # after the stream began: an error event ends it
                for text in render(ev) or [sse({"error": ev.error.body()["error"]})]:
                    yield text
                return
            for text in render(ev):
                yield text
            if isinstance(ev, Done):
                for text in closing():
                    yield text
                return
            ev = await job.next_event()

    return EventStream(body(), job.cancel)
