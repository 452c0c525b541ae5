"""Request bodies of the OpenAI-compatible endpoints as pydantic models: bad input is refused
with a precise message, harmless unknown fields are ignored, and fields that would change the
meaning of a request this server cannot honour (tools, audio, images) are refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
# Template variables a request may not set through chat_template_kwargs: the server's own.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token",
                                    "eos_token"})
REASONING_FORMATS = ("none", "deepseek", "auto")


class _Body(BaseModel):
    # Unknown fields are ignored: clients send many that do not change the answer (user,
    # metadata, service_tier, store, ...). Those that would change it are declared and refused.
    model_config = ConfigDict(extra="ignore")


# Fields a client may send that would change what the answer means: refused when set.
UNSUPPORTED = {
    "tools": "function calling is not supported by this server",
    "functions": "function calling is not supported by this server",
    "audio": "audio output is not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "background": "background responses are not supported by this server",
    "conversation": "stored conversations are not supported (use previous_response_id)",
    "prompt": "stored prompt templates are not supported by this server",
}


def _refuse(value, info):
    if value:
        raise ValueError(UNSUPPORTED[info.field_name])
    return value


def _tool_choice_value(value):
    """none, auto, required, or {"type": "function", "function": {"name": ...}}."""
    if value is None or value in ("none", "auto", "required"):
        return value
    if (isinstance(value, dict) and value.get("type") == "function"
            and isinstance((value.get("function") or {}).get("name"), str)):
        return value
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     '{"type": "function", "function": {"name": ...}}')


# ----------------------------------------------------------------------------- messages

class ContentPart(_Body):
    """One part of a message's content; only text parts can be read by a text model."""
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type in ("text", "input_text", "output_text"):
            if self.text is None:
                raise ValueError(f"a {self.type!r} part needs a 'text' field")
            return self
        raise ValueError(f"content parts of type {self.type!r} are not supported: "
                         "this model reads text only")


Content = Union[str, list[ContentPart]]


def content_text(content: Content | None) -> str:
    """A message's content as one string (text parts joined by newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p.text or "" for p in content)


def template_message(role: str, content: Content | None, reasoning: str | None = None) -> dict:
    """A message as chat templates take it. 'developer' is the newer name of 'system',
    which is the only one templates know. An earlier answer's reasoning goes in both names
    templates read it by: ``reasoning_content`` (Qwen3, DeepSeek) and ``thinking`` (gpt-oss)."""
    m = {"role": "system" if role == "developer" else role, "content": content_text(content)}
    if reasoning:
        m["reasoning_content"] = m["thinking"] = reasoning
    return m


def check_template_kwargs(value: dict | None) -> dict | None:
    """Refuse template variables the server sets itself."""
    taken = sorted(RESERVED_TEMPLATE_VARS & set(value or ()))
    if taken:
        raise ValueError(f"{', '.join(taken)} cannot be set here: the server sets "
                         f"{'it' if len(taken) == 1 else 'them'} itself")
    return value


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    reasoning_content: str | None = None   # an earlier answer's reasoning, for the template

    @model_validator(mode="after")
    def _supported(self):
        if self.role == "function" or self.function_call:
            raise ValueError("the legacy 'function' role and function_call are not supported; "
                             "use tool_calls and 'tool' messages")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def as_template_message(self) -> dict:
        m = template_message(self.role, self.content, self.reasoning_content)
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            m["name"] = self.name
        return m


# ----------------------------------------------------------------------------- output format

class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``response_format`` of chat completions: OpenAI's shape (json_schema.schema) or
    llama.cpp's (the schema beside the type, for json_object too)."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None and self.schema_ is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' field")
        return self

    def schema(self) -> dict | None:
        """The schema asked for, in either shape (None: any JSON object, or plain text)."""
        return self.json_schema.schema_ if self.json_schema is not None else self.schema_


# llama.cpp's sampling extensions this server cannot honour, with the value that means
# "off": a request giving another value is refused by name rather than silently ignored.
LLAMA_OFF = {"typical_p": 1.0, "mirostat": 0, "mirostat_tau": None, "mirostat_eta": None,
             "dynatemp_range": 0.0, "dynatemp_exponent": None, "tfs_z": 1.0,
             "xtc_probability": 0.0, "xtc_threshold": None, "dry_multiplier": 0.0,
             "dry_base": None, "dry_allowed_length": None, "dry_penalty_last_n": None,
             "dry_sequence_breakers": None, "top_n_sigma": -1.0, "n_keep": 0,
             "penalize_nl": False, "samplers": None, "lora": None, "id_slot": -1,
             "n_indent": 0, "t_max_predict_ms": 0, "t_max_prompt_ms": 0, "n_discard": 0}


def refuse_llama_extras(extra: dict | None) -> None:
    """Raises ValueError naming the first llama.cpp field whose value would change the answer
    (mirostat, typical_p, ...): this server does not implement them."""
    for name, off in LLAMA_OFF.items():
        if extra and name in extra and extra[name] is not None and extra[name] != off:
            raise ValueError(f"{name}: this server does not support {name} (send "
                             f"{off!r} or leave it out)" if off is not None else
                             f"{name}: this server does not support {name} (leave it out)")


# ----------------------------------------------------------------------------- sampling

class SamplingFields(_Body):
    """Sampling fields common to every generating endpoint (OpenAI's, plus llama.cpp's
    top_k, min_p, repeat_penalty and ignore_eos)."""
    model_config = ConfigDict(extra="allow")   # read by _llama_extras, then ignored
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    seed: int | None = Field(None, ge=-1, lt=2 ** 64, description="-1: random")
    ignore_eos: bool = False
    repeat_last_n: int | None = Field(None, ge=-1)
    cache_prompt: bool = True   # prefixes are always reused: the answer is the same either way

    @model_validator(mode="after")
    def _llama_extras(self):
        refuse_llama_extras(self.model_extra)
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, v):
        for k in v or {}:
            if not k.lstrip("-").isdigit() or int(k) < 0:
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}")
        return v


class StreamOptions(_Body):
    include_usage: bool = False


class ChatFields(SamplingFields):
    """What chat completions and completions share."""
    model: str | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    # llama.cpp's constraints: a GBNF grammar, or a JSON schema the output must match
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    n_probs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class ChatCompletionRequest(ChatFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    # reasoning: the effort (templates that take it, e.g. gpt-oss), further template
    # variables (e.g. {"enable_thinking": false}), and whether it is split from the content
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: Literal[REASONING_FORMATS] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # Declared only to be refused when set: each would change what the answer means.
    functions: list[Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None

    _unsupported = field_validator("functions", "audio", "web_search_options")(_refuse)
    _tool_choice = field_validator("tool_choice")(_tool_choice_value)
    _template_kwargs = field_validator("chat_template_kwargs")(check_template_kwargs)

    def template_kwargs(self) -> dict:
        """The variables this request adds to the chat template's rendering."""
        kw = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kw["reasoning_effort"] = self.reasoning_effort
        return kw

    @field_validator("modalities")
    @classmethod
    def _text_modality(cls, v):
        if v and set(v) != {"text"}:
            raise ValueError("only the 'text' modality is supported")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v


class CompletionRequest(ChatFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None   # fill in the middle: the prompt is the prefix

    @model_validator(mode="after")
    def _meaning(self):
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of other than n is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list of texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# ----------------------------------------------------------------------------- responses

class InputMessage(_Body):
    """An input item of the Responses API: a message."""
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Content
    id: str | None = None
    status: str | None = None

    def as_template_message(self) -> dict:
        return template_message(self.role, self.content)


class TextFormat(_Body):
    """``text.format`` of the Responses API (the schema sits beside the type there)."""
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a format of type 'json_schema' needs a 'schema' field")
        return self


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(_Body):
    """``reasoning`` of the Responses API: the effort goes to templates that read it."""
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None


class FunctionCallItem(_Body):
    """An input item: an earlier answer's function call (as the output gave it)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = "{}"
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    """An input item: a function call's result."""
    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _function_tools(value):
    """The Responses API's function tools ({"type": "function", "name": ...})."""
    for t in value or ():
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise ValueError(f"tools of type {kind!r} are not supported: only function tools")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise ValueError("a function tool needs a name")
    return value


def _responses_tool_choice(value):
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" \
            and isinstance(value.get("name"), str):
        return value
    raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                     '{"type": "function", "name": ...}')


class ResponsesRequest(SamplingFields):
    model: str | None = None
    input: str | list[Union[InputMessage, FunctionCallItem, FunctionCallOutputItem]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool = False
    store: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    parallel_tool_calls: bool | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None

    _unsupported = field_validator("background", "conversation", "prompt")(_refuse)
    _tools = field_validator("tools")(_function_tools)
    _tool_choice = field_validator("tool_choice")(_responses_tool_choice)

    @field_validator("input")
    @classmethod
    def _some_input(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        return v

    def input_messages(self) -> list[dict]:
        """The input as template messages: function calls as an assistant message's
        tool_calls (consecutive calls in one message), their outputs as tool messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for m in self.input:
            if isinstance(m, FunctionCallItem):
                call = {"id": m.call_id, "type": "function",
                        "function": {"name": m.name, "arguments": m.arguments}}
                if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                    out[-1]["tool_calls"].append(call)
                elif out and out[-1]["role"] == "assistant":
                    out[-1]["tool_calls"] = [call]
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif isinstance(m, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": m.call_id, "content": m.output})
            else:
                out.append(m.as_template_message())
        return out

    def chat_tools(self) -> list[dict] | None:
        """The function tools in the chat API's shape."""
        return [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description"),
            "parameters": t.get("parameters") or {"type": "object"}}}
            for t in self.tools] if self.tools else None

    def chat_tool_choice(self):
        """tool_choice in the chat API's shape."""
        c = self.tool_choice
        if isinstance(c, dict):
            return {"type": "function", "function": {"name": c["name"]}}
        return c


# ----------------------------------------------------------------------------- tokens

class TokenizeRequest(_Body):
    model: str | None = None
    content: str | None = None
    messages: list[ChatMessage] | None = None
    add_special: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.content is None) == (self.messages is None):
            raise ValueError("give either 'content' (text) or 'messages' (a conversation)")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

