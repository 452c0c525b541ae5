"""Chat templates: the GGUF's `tokenizer.chat_template` or a builtin, rendered in a jinja2 sandbox.

Rendering follows Hugging Face transformers (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a non-escaping `tojson`),
under the time and size limits of `localllm.text.template_guard`. The builtins reproduce
llama.cpp's own formats of the same names (llama-chat.cpp).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
from typing import Any, Mapping

import jinja2
import jinja2.ext
import jinja2.sandbox

from localllm.errors import TemplateError
from localllm.text.template_guard import GuardedEnvironment, LimitExceeded, RenderLimits

_C_SPACE = " \t\n\x0b\x0c\r"  # isspace() in the C locale: what llama.cpp's trim() strips


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    content = "(m['content'] | cstrip)" if strip else "m['content']"
    sys_part = ("'<<SYS>>\\n' + c + '\\n<</SYS>>\\n\\n'" if system else "c + '\\n'")
    reopen = "'<s>[INST] '" if bos_inside else "'[INST] '"
    return (
        "{% set ns = namespace(inside=true) %}{{ '[INST] ' }}"
        "{% for m in messages %}{% set c = " + content + " %}"
        "{% if not ns.inside %}{% set ns.inside = true %}{{ " + reopen + " }}{% endif %}"
        "{% if m['role'] == 'system' %}{{ " + sys_part + " }}"
        "{% elif m['role'] == 'user' %}{{ c + ' [/INST]' }}"
        "{% else %}{{ c + '</s>' }}{% set ns.inside = false %}{% endif %}{% endfor %}"
    )


def _mistral(leading: str, trailing: str, trim_assistant: bool) -> str:
    answer = "(m['content'] | cstrip)" if trim_assistant else "m['content']"
    return (
        "{% set ns = namespace(inside=false) %}{% for m in messages %}"
        "{% if not ns.inside %}{{ '" + leading + "[INST]" + trailing + "' }}"
        "{% set ns.inside = true %}{% endif %}"
        "{% if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}"
        "{% elif m['role'] == 'user' %}{{ m['content'] + '" + leading + "[/INST]' }}"
        "{% else %}{{ '" + trailing + "' + " + answer + " + '</s>' }}{% set ns.inside = false %}"
        "{% endif %}{% endfor %}"
    )


def _mistral_v7(space: str) -> str:
    return (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ '[SYSTEM_PROMPT]" + space + "' + m['content'] + '[/SYSTEM_PROMPT]' }}"
        "{% elif m['role'] == 'user' %}{{ '[INST]" + space + "' + m['content'] + '[/INST]' }}"
        "{% else %}{{ '" + space + "' + m['content'] + '</s>' }}{% endif %}{% endfor %}"
    )


# name -> jinja source; each renders what llama.cpp's builtin of that name renders.
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "gemma": (
        # system turns are folded into the next user turn, as Gemma has no system role
        "{% set ns = namespace(sys='') %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set ns.sys = ns.sys + (m['content'] | cstrip) %}"
        "{% else %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' }}"
        "{% if ns.sys and role != 'model' %}{{ ns.sys + '\\n\\n' }}{% set ns.sys = '' %}{% endif %}"
        "{{ (m['content'] | cstrip) + '<end_of_turn>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "llama3": (
        "{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + "
        "(m['content'] | cstrip) + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
        "{% endif %}"
    ),
    "mistral-v1": _mistral(" ", " ", False),
    "mistral-v3": _mistral("", " ", True),
    "mistral-v3-tekken": _mistral("", "", False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
    "zephyr": (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|endoftext|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
    ),
}
BUILTIN_TEMPLATES["mistral"] = BUILTIN_TEMPLATES["mistral-v3"]

# (token text that marks the family, builtin) for files without a template
_BY_VOCAB = (
    ("<start_of_turn>", "gemma"),
    ("<|start_header_id|>", "llama3"),
    ("<|im_start|>", "chatml"),
    ("[SYSTEM_PROMPT]", "mistral-v7"),
    ("[INST]", "mistral-v3"),
)
_BY_ARCH = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
            "phi3": "phi3"}


def _raise_exception(message: str = "") -> None:
    raise TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping, unicode kept; what a filter such as map or
    # select yields (a generator) is written as the list it yields, as minja does
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=_json_sequence)


def _json_sequence(x: Any) -> list:
    if isinstance(x, (str, bytes, Mapping)) or not hasattr(x, "__iter__"):
        raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")
    return list(x)


def _cstrip(s: Any) -> str:
    return str(s).strip(_C_SPACE)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's own
    tokens with it (for training masks); rendering outputs the body as it is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _environment(limits: RenderLimits) -> GuardedEnvironment:
    env = GuardedEnvironment(limits, trim_blocks=True, lstrip_blocks=True,
                             extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.filters["cstrip"] = _cstrip
    env.guard_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _hint(name: str) -> str:
    names = ", ".join(sorted(BUILTIN_TEMPLATES))
    return (f"chat template {name!r}: choose another with --chat-template NAME|FILE "
            f"(builtins: {names})")


def _token_text(meta: Mapping[str, Any], key: str) -> str:
    tokens = meta.get("tokenizer.ggml.tokens")
    tid = meta.get(f"tokenizer.ggml.{key}_token_id")
    if tokens is None or tid is None or not 0 <= int(tid) < len(tokens):
        return ""
    return str(tokens[int(tid)])


class ChatTemplate:
    """A compiled chat template.

    Attributes:
        name: "file" for the GGUF's own template, a builtin name, or the override's path.
        source: the jinja source.
        bos_token, eos_token: the token texts the template sees. A rendered prompt may
            start with bos_token: encode it with add_special=False then, or drop it.
        limits: the time and sizes one rendering may take (a template is untrusted code).
    """

    def __init__(self, source: str, name: str, bos_token: str = "", eos_token: str = "",
                 limits: RenderLimits = RenderLimits()):
        self.name = name
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.limits = limits
        self._env = _environment(limits)
        try:
            self._template = self._env.compile_template(source)
        except jinja2.TemplateError as e:
            raise TemplateError(f"{_hint(name)}; it does not compile: {e}") from None

    @property
    def from_file(self) -> bool:
        """Whether this is the model file's own template (a file without one is taken for a
        base model: `llm run` continues its prompt as text)."""
        return self.name == "file"

    @classmethod
    def resolve(cls, meta: Mapping[str, Any], override: str | None = None,
                limits: RenderLimits = RenderLimits()) -> "ChatTemplate":
        """Pick the template for a model.

        Args:
            meta: GGUF metadata.
            override: a builtin name, a named template in the file
                (`tokenizer.chat_template.NAME`), or a path to a jinja file.
            limits: what one rendering may cost.
        Returns:
            the override if given; else the file's `tokenizer.chat_template`; else a builtin
            chosen by vocabulary or architecture (Gemma -> "gemma"); else "chatml", which is
            llama.cpp's fallback too.
        Raises:
            TemplateError: unknown override, unreadable file, or a template that does not compile.
        """
        bos, eos = _token_text(meta, "bos"), _token_text(meta, "eos")
        if override is not None:
            if override in BUILTIN_TEMPLATES:
                return cls(BUILTIN_TEMPLATES[override], override, bos, eos, limits)
            named = meta.get(f"tokenizer.chat_template.{override}")
            if isinstance(named, str):
                return cls(named, override, bos, eos, limits)
            if os.path.isfile(override):
                try:
                    with open(override, encoding="utf-8") as f:
                        return cls(f.read(), override, bos, eos, limits)
                except (OSError, UnicodeDecodeError) as e:
                    raise TemplateError(f"{_hint(override)}; cannot read it: {e}") from None
            raise TemplateError(f"{_hint(override)}; it is neither a builtin nor a file")
        source = meta.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            return cls(source, "file", bos, eos, limits)
        name = cls.default_builtin(meta)
        return cls(BUILTIN_TEMPLATES[name], name, bos, eos, limits)

    @staticmethod
    def default_builtin(meta: Mapping[str, Any]) -> str:
        """Returns: the builtin used for a file without a chat template."""
        arch = str(meta.get("general.architecture", ""))
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
        vocab = set(meta.get("tokenizer.ggml.tokens") or ())
        for text, name in _BY_VOCAB:
            if text in vocab:
                return name
        if str(meta.get("tokenizer.ggml.model", "")) == "llama" and arch == "llama":
            return "llama2"
        return "chatml"

    def render_with_spans(self, messages: list[dict], add_generation_prompt: bool = True,
                          tools=None, **extra) -> tuple[str, list[tuple[int, int]]]:
        """Render, and find where each message's text landed in the prompt.

        Returns:
            (prompt, spans): spans are (start, end) ranges of message contents, found in
            order (verbatim or stripped); pass them as Tokenizer.encode(literal_spans=...)
            so control-token look-alikes typed by a user stay plain text. A content the
            template rewrote is not found and gets no span.
        """
        text = self.render(messages, add_generation_prompt, tools, **extra)
        spans, cursor = [], 0
        for m in messages:
            content = m.get("content") if isinstance(m, Mapping) else None
            if not isinstance(content, str):
                continue
            for needle in (content, content.strip(_C_SPACE), content.strip()):
                at = text.find(needle, cursor) if needle else -1
                if at >= 0:
                    spans.append((at, at + len(needle)))
                    cursor = at + len(needle)
                    break
        return text, spans

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
               **extra) -> str:
        """Render a conversation.

        Args:
            messages: [{"role": ..., "content": ...}, ...] (system, user, assistant, tool).
            add_generation_prompt: end with the header of an assistant turn.
            tools: tool definitions for templates that take them.
            **extra: further template variables (e.g. enable_thinking).
        Returns:
            the prompt text (encode it with parse_special=True).
        Raises:
            TemplateError: the template raised, touched an undefined value, broke the
                sandbox, or went past its limits (time, sizes, range, repetition).
        """
        context = dict(extra)
        # copies: a template may append to or pop from lists (namespace queues), never the
        # caller's
        context.update(messages=copy.deepcopy(messages),
                       add_generation_prompt=add_generation_prompt, tools=copy.deepcopy(tools), bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            with self._env.rendering() as budget:
                parts, size = [], 0
                for chunk in self._template.generate(**context):
                    size += len(chunk)
                    budget.allow(size, "the rendered prompt")
                    parts.append(chunk)
                return "".join(parts)
        except LimitExceeded as e:
            raise TemplateError(f"{_hint(self.name)}; rendering refused: {e}") from None
        except TemplateError as e:
            raise TemplateError(f"{_hint(self.name)}; the template raised: {e}") from None
        except jinja2.exceptions.SecurityError as e:
            raise TemplateError(f"{_hint(self.name)}; blocked by the sandbox: {e}") from None
        except Exception as e:  # jinja2 errors, and Python errors from inside the template
            raise TemplateError(f"{_hint(self.name)}; rendering failed: "
                                f"{type(e).__name__}: {e}") from None
