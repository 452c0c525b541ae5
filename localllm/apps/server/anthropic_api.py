"""POST /v1/messages, Anthropic's Messages API: its request translated into the OpenAI-shaped
conversation the chat endpoint renders, its answer as content blocks (thinking from the
reasoning split, text, tool_use), streamed as Anthropic's events, errors in Anthropic's shape."""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from localllm.errors import LocalLLMError
from .common import ServerState, event_stream, new_id, respond, sse
from .errors import APIError, anthropic_error_body, api_error
from .runs import Event, Failed, Finished, GenerationSpec, Piece, Prompt, Started
from .schemas import MAX_STOP, SamplingFields, template_message
from .tool_use import (CallArgs, CallDone, CallStart, StreamSplitter, ToolPlan, arguments_json,
                       plan)

router = APIRouter()

error_body = anthropic_error_body


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


# ----------------------------------------------------------------------------- the request

class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""
    signature: str | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[TextBlock]] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text for b in self.content)


Block = Union[TextBlock, ThinkingBlock, ToolUseBlock, ToolResultBlock]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v):
        known = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")
        for b in v if isinstance(v, list) else ():
            kind = b.get("type") if isinstance(b, dict) else None
            if kind not in known:
                raise ValueError(f"content blocks of type {kind!r} are not supported: this "
                                 "model reads text only")
        return v


class Tool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class MessagesRequest(SamplingFields):
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[TextBlock], None] = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    metadata: dict[str, Any] | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v):
        if v and len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in v or ()):
            raise ValueError("stop sequences must not be empty")
        return v


def _tool_choice(choice: dict[str, Any] | None):
    """Anthropic's tool_choice as OpenAI's."""
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind, "auto")


def to_openai(req: MessagesRequest) -> dict:
    """The request as an OpenAI chat request's fields: system first, tool_result blocks as
    tool messages (before the rest of their user turn), tool_use blocks as an assistant
    message's tool_calls, thinking blocks as its reasoning_content, tools as functions.

    Args:
        req: the validated Messages request.
    Returns:
        {"messages": [...], "tools": [...] or None, "tool_choice": ... or None}
    """
    out: list[dict] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else \
            "\n".join(b.text for b in req.system)
        out.append({"role": "system", "content": system})
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) \
            else m.content
        texts = [b.text for b in blocks if isinstance(b, TextBlock)]
        if m.role == "user":
            for b in blocks:
                if isinstance(b, ToolResultBlock):
                    out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                                "content": b.text()})
            if texts or not any(isinstance(b, ToolResultBlock) for b in blocks):
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if thinking:
            msg["reasoning_content"] = thinking
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}}
             for t in req.tools] if req.tools else None
    return {"messages": out, "tools": tools, "tool_choice": _tool_choice(req.tool_choice)}


def _template_messages(chat: dict) -> list[dict]:
    """The translated conversation as chat templates take it (calls and results kept)."""
    out = []
    for m in chat["messages"]:
        t = template_message(m["role"], m["content"], m.get("reasoning_content"))
        if m.get("tool_calls"):
            t["tool_calls"] = m["tool_calls"]
        if m.get("tool_call_id") is not None:
            t["tool_call_id"] = m["tool_call_id"]
        out.append(t)
    return out


def _tool_use_id(call_id: str) -> str:
    """A call's id in Anthropic's toolu_ form."""
    return "toolu_" + call_id.removeprefix("call_")


def _tool_use_block(call) -> dict:
    """A call as a tool_use content block."""
    return {"type": "tool_use", "id": _tool_use_id(call.id),
            "name": call.name, "input": arguments_json(call)}


# ----------------------------------------------------------------------------- the answer

def _stop_reason(ev: Finished | None, called: bool = False) -> tuple[str, str | None]:
    if ev is None or ev.finish_reason == "length":
        return "max_tokens", None
    if ev.stop_sequence is not None:
        return "stop_sequence", ev.stop_sequence
    return ("tool_use" if called else "end_turn"), None


def _usage(events: list[Event]) -> dict:
    fin = next((e for e in events if isinstance(e, Finished)), None)
    u = fin.usage if fin else None
    return {"input_tokens": u.prompt_tokens if u else 0,
            "output_tokens": u.completion_tokens if u else 0,
            "cache_read_input_tokens": u.cached_tokens if u else 0,
            "cache_creation_input_tokens": 0}


def _whole(events: list[Event], head: dict, tools: ToolPlan) -> JSONResponse:
    reasoning = "".join(e.reasoning for e in events if isinstance(e, Piece))
    pieces = [e for e in events if isinstance(e, Piece)]
    text, calls = tools.split("".join(e.text for e in pieces),
                              [p for e in pieces for p in e.tool_calls])
    content = []
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not (reasoning or calls):
        content.append({"type": "text", "text": text})
    content += [_tool_use_block(c) for c in calls]
    reason, seq = _stop_reason(next((e for e in events if isinstance(e, Finished)), None),
                               bool(calls))
    return JSONResponse({**head, "content": content, "stop_reason": reason,
                         "stop_sequence": seq, "usage": _usage(events)})


class _Blocks:
    """The stream's content blocks: one open at a time, a new one when the kind changes."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None
        self.pinged = False

    def text(self, kind: str, text: str) -> list[str]:
        out = []
        if kind != self.kind:
            out += self.close()
            self.index += 1
            self.kind = kind
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            out.append(sse({"type": "content_block_start", "index": self.index,
                            "content_block": block}, "content_block_start"))
            out += self.ping()
        delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" \
            else {"type": "text_delta", "text": text}
        out.append(sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                       "content_block_delta"))
        return out

    def calls(self, events: list) -> list[str]:
        """A StreamSplitter's call events as tool_use blocks: started with an empty input
        once the name is known, the arguments as input_json_deltas, stopped when done."""
        out = []
        for ev in events:
            if isinstance(ev, CallStart):
                out += self.close()
                self.index += 1
                self.kind = "tool_use"
                block = {"type": "tool_use", "id": _tool_use_id(ev.id), "name": ev.name,
                         "input": {}}
                out.append(sse({"type": "content_block_start", "index": self.index,
                                "content_block": block}, "content_block_start"))
                out += self.ping()
            elif isinstance(ev, CallArgs):
                out.append(sse({"type": "content_block_delta", "index": self.index,
                                "delta": {"type": "input_json_delta",
                                          "partial_json": ev.fragment}},
                               "content_block_delta"))
            elif isinstance(ev, CallDone):
                out += self.close()
        return out

    def ping(self) -> list[str]:
        if self.pinged:
            return []
        self.pinged = True
        return [sse({"type": "ping"}, "ping")]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(sse({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "signature_delta", "signature": ""}},
                           "content_block_delta"))
        out.append(sse({"type": "content_block_stop", "index": self.index},
                       "content_block_stop"))
        self.kind = None
        return out


def _stream(first: Event, job, head: dict, tools: ToolPlan):
    blocks = _Blocks()
    split = StreamSplitter(tools)

    def render(ev: Event) -> list[str]:
        if isinstance(ev, Started):
            usage = {"input_tokens": ev.prompt_tokens, "output_tokens": 0}
            return [sse({"type": "message_start",
                         "message": {**head, "content": [], "stop_reason": None,
                                     "stop_sequence": None, "usage": usage}},
                        "message_start")]
        if isinstance(ev, Piece):
            out = blocks.text("thinking", ev.reasoning) if ev.reasoning else []
            text = split.feed(ev.text, ev.tool_calls) if ev.text or ev.tool_calls else ""
            out += blocks.text("text", text) if text else []
            return out + blocks.calls(split.take())
        if isinstance(ev, Finished):
            began = bool(split.started)
            rest, calls = split.finish()
            if began:   # the calls' blocks are open or done: finish them, then the text
                out = blocks.calls(split.take()) + blocks.close()
                out += blocks.text("text", rest) if rest else []
            else:
                out = blocks.text("text", rest) if rest else []
                out += blocks.calls(split.take())
            out += blocks.close() + blocks.ping()
            reason, seq = _stop_reason(ev, bool(calls))
            return out + [sse({"type": "message_delta",
                               "delta": {"stop_reason": reason, "stop_sequence": seq},
                               "usage": {"output_tokens": ev.usage.completion_tokens}},
                              "message_delta"),
                          sse({"type": "message_stop"}, "message_stop")]
        if isinstance(ev, Failed):
            return [sse(error_body(ev.error.status, ev.error.message), "error")]
        return []

    return event_stream(first, job, render, lambda: [])


# ----------------------------------------------------------------------------- the route

def _validation_message(e: ValidationError) -> str:
    err = next((x for x in e.errors() if x.get("type") == "value_error"), e.errors()[0])
    loc = ".".join(str(p) for p in err.get("loc", ()))
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg


@router.post("/v1/messages")
async def messages(request: Request):
    """Anthropic's Messages API, answered by the loaded model."""
    try:
        return await _messages(request)
    except APIError as e:
        return error_response(e.status, e.message, e.headers)
    except LocalLLMError as e:
        err = api_error(e)
        return error_response(err.status, err.message)
    except HTTPException as e:   # a body too large or too slow, found while reading it
        return error_response(e.status_code, str(e.detail))


async def _messages(request: Request):
    st: ServerState = request.app.state.server
    try:
        raw = json.loads(await request.body() or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        body = MessagesRequest.model_validate(raw)
    except ValidationError as e:
        raise APIError(400, _validation_message(e)) from None
    st.check_model(body.model)
    chat = to_openai(body)
    kwargs = {}
    if body.thinking is not None:
        kwargs["enable_thinking"] = body.thinking.type != "disabled"
    source = await st.scheduler.call(lambda m: m.template.source)
    parallel = not (body.tool_choice or {}).get("disable_parallel_tool_use", False)
    tools = plan(source, _template_messages(chat), kwargs, chat["tools"], chat["tool_choice"],
                 parallel)
    sampling = st.sampling(body, body.max_tokens, body.stop_sequences or None)
    spec = GenerationSpec([Prompt(messages=tools.messages, template_kwargs=tools.template_kwargs)],
                          sampling, output=tools.output,
                          split_reasoning=st.settings.reasoning_format != "none")
    job = st.scheduler.submit(spec)
    head = {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": body.model}
    stream = (lambda first: _stream(first, job, head, tools)) if body.stream else None
    return await respond(job, request, stream, lambda events: _whole(events, head, tools))
