"""Tool calls held to the tools' schemas over SmolLM2's real vocabulary: the lazy constraint
(free text until the format's trigger, then the call), the forced one (the call from the
first token), and what the tool plan picks for each template and tool_choice."""

import json

import numpy as np
import pytest
from jsonschema import Draft202012Validator

from localllm.errors import ConstraintError
from localllm.generation.constrain import TokenVocab
from localllm.generation.constrain.calls import LazyConstraint, ToolGrammar
from localllm.formats.fetch import vocab_suite_dir
from localllm.generation.tool_use import plan
from localllm.text.chat_template import ChatTemplate
from localllm.text.tokenizer import Tokenizer
from localllm.generation.constrain.grammar import lit
from localllm.text.tool_calls import (DEEPSEEK_R1, DEEPSEEK_V31, FUNCTIONARY_V32, GENERIC, GLM,
                                      HARMONY, HERMES, LLAMA3, MISTRAL, MISTRAL_NEMO, QWEN3_CODER,
                                      ToolCall, ToolFormat, canonical_text)
from tests.support.tools import TIME, TIME_PARAMS, WEATHER, WEATHER_PARAMS

TOOLS = [WEATHER, TIME]
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
HERMES_TEMPLATE = "{% if tools %}<tool_call>{% endif %}"
LLAMA3_TEMPLATE = '{% if tools %}<|start_header_id|>"parameters"{% endif %}'
NEMO_TEMPLATE = "{% if tools %}[TOOL_CALLS]{% endif %}"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(metas):
    return Tokenizer.from_metadata(metas["smollm"])


@pytest.fixture(scope="module")
def vocab(tok):
    return TokenVocab.from_tokenizer(tok)


@pytest.fixture(scope="module")
def lazy(vocab):
    """The Hermes auto plan's constraint, built once (give each test a copy)."""
    return plan(HERMES_TEMPLATE, USER, {}, TOOLS, "auto", True).constraint(vocab)


def ids_of(tok, *pieces: str) -> list[int]:
    """Token ids of each piece encoded on its own (so a trigger can be split on purpose)."""
    return [i for p in pieces for i in tok.encode(p, add_special=False)]


def feed(c, ids):
    for i in ids:
        assert c.allowed(i), f"token {i} refused"
        c.advance(i)


def valid_calls(fmt: ToolFormat, text: str) -> list[tuple[str, dict]]:
    """The calls in text, each checked against its tool's schema."""
    _, calls = fmt.parse(text)
    out = []
    for c in calls:
        args = json.loads(c.arguments)
        Draft202012Validator(PARAMS[c.name]).validate(args)
        out.append((c.name, args))
    return out


def test_free_text_then_a_call(tok, vocab, lazy):
    c = lazy.copy()
    feed(c, ids_of(tok, "Let me look that up. I will call it now: "))
    assert not c.triggered and c.is_complete() and c.mask().all()
    feed(c, ids_of(tok, "<tool_call>"))
    assert c.triggered and not c.is_complete()
    call = '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    feed(c, ids_of(tok, call))
    assert c.is_complete()
    c.advance(int(vocab.eog[0]))
    assert c.must_end()
    assert valid_calls(HERMES, "x <tool_call>" + call) == [("get_weather",
                                                              {"city": "Paris", "unit": "c"})]


def test_text_alone_may_end(tok, vocab, lazy):
    c = lazy.copy()
    feed(c, ids_of(tok, "No tool is needed: it is sunny."))
    assert c.allowed(int(vocab.eog[0])) and c.is_complete() and not c.must_end()


@pytest.mark.parametrize("pieces", [["<", "tool", "_", "call", ">"], ["<tool", "_call>"],
                                    ["<tool_", "call", ">"]])
def test_a_split_trigger(tok, lazy, pieces):
    c = lazy.copy()
    feed(c, ids_of(tok, "Sure "))
    for p in pieces[:-1]:
        feed(c, ids_of(tok, p))
        assert not c.triggered
    feed(c, ids_of(tok, pieces[-1]))
    assert c.triggered
    assert not c.allowed(ids_of(tok, "Paris")[0])   # only the call may follow now


def test_a_token_with_the_trigger_and_more(tok, vocab, lazy):
    c = lazy.copy()
    feed(c, ids_of(tok, "ok <tool_call"))
    m = c.mask()
    assert m.tolist() == [c.allowed(t) for t in range(vocab.size)]
    # A token that finishes the trigger is checked with the text it carries after it: in
    # SmolLM2's vocabulary none of ">>", "><", ">=", '>"' ... can begin a call.
    more = {vocab.token_bytes(t): t for t in range(vocab.size)
            if vocab.token_bytes(t)[:1] == b">"}
    assert len(more) > 5 and m[more[b">"]]
    assert not any(m[t] for b, t in more.items() if len(b) > 1)
    with pytest.raises(ConstraintError):
        c.copy().advance(more[b">>"])
    c.advance(more[b">"])
    assert c.triggered


def test_text_before_the_trigger_inside_one_token(vocab):
    # A synthetic vocabulary with one token holding text, the whole trigger and the call's
    # first characters, and one whose text after the trigger breaks the call.
    pieces = [bytes([b]) for b in range(256)] + [b'ok<tool_call>\n{"', b"<tool_call>}", b"<eos>"]
    v = TokenVocab.from_pieces(pieces, eog=[258])
    c = plan(HERMES_TEMPLATE, USER, {}, TOOLS, "auto", True).constraint(v)
    assert c.allowed(256) and not c.allowed(257)
    assert not c.mask()[257]
    c.advance(256)
    assert c.triggered
    for b in b'name": "get_time", "arguments": {"zone": 3}}\n</tool_call>':
        c.advance(b)
    assert c.is_complete()


def test_invalid_json_after_the_trigger_is_refused(tok, lazy):
    c = lazy.copy()
    feed(c, ids_of(tok, "<tool_call>\n{\"name\": \"get_"))
    for bad in ["wind", "weather\", \"args", "weather\", \"arguments\": {\"city\": 3"]:
        d = c.copy()
        with pytest.raises(ConstraintError):
            for i in ids_of(tok, bad):
                d.advance(i)
    feed(c, ids_of(tok, 'time", "arguments": {"zone": '))
    for bad in ["15", "-13", "\"3\"", "3.5"]:
        d = c.copy()
        with pytest.raises(ConstraintError):
            feed_all = ids_of(tok, bad) + ids_of(tok, "}}")
            for i in feed_all:
                d.advance(i)


def sample(c, vocab, rng, cap=400):
    """Random tokens from the mask, weighted to short pieces (the call ends sooner), until an
    end token; returns the text, or None past ``cap`` tokens."""
    eog = int(vocab.eog[0])
    out = []
    for _ in range(cap):
        m = c.mask()
        ok = np.setdiff1d(np.flatnonzero(m), vocab.eog)
        if m[eog] and (not ok.size or rng.random() < 0.5):
            c.advance(eog)
            return b"".join(out).decode()
        w = 1.0 / (1 + (vocab.off[ok + 1] - vocab.off[ok])) ** 3
        t = int(rng.choice(ok, p=w / w.sum()))
        c.advance(t)
        out.append(vocab.token_bytes(t))
    return None


def test_random_walks_after_the_trigger_always_parse(tok, vocab, lazy):
    rng = np.random.default_rng(7)
    done = 0
    for _ in range(12):
        c = lazy.copy()
        feed(c, ids_of(tok, "Checking. <tool_call>"))
        text = sample(c, vocab, rng)
        if text is None:
            continue
        done += 1
        calls = valid_calls(HERMES, "Checking. <tool_call>" + text)
        assert calls and all(n in PARAMS for n, _ in calls)
    assert done >= 6


def test_required_holds_the_native_shape_from_the_first_token(tok, vocab):
    p = plan(HERMES_TEMPLATE, USER, {}, TOOLS, "required", True)
    assert p.fmt is HERMES and isinstance(p.schema, ToolGrammar) and not p.schema.trigger
    assert p.messages == USER   # the template teaches the format: no system prompt added
    c = p.constraint(vocab)
    assert not isinstance(c, LazyConstraint)
    assert not c.allowed(ids_of(tok, "Sure")[0]) and not c.allowed(int(vocab.eog[0]))
    rng = np.random.default_rng(3)
    texts = [t for t in (sample(c.copy(), vocab, rng) for _ in range(8)) if t is not None]
    assert len(texts) >= 4
    for t in texts:
        assert valid_calls(HERMES, t)


def test_named_function_is_that_one_call(tok, vocab):
    p = plan(HERMES_TEMPLATE, USER, {}, TOOLS, {"type": "function",
                                                "function": {"name": "get_time"}}, True)
    assert not p.schema.repeat
    c = p.constraint(vocab)
    feed(c, ids_of(tok, "<tool_call>\n{\"name\": \"get_"))
    with pytest.raises(ConstraintError):
        c.copy().advance(ids_of(tok, "weather")[0])


def test_llama3_bare_json_counts_only_at_the_start(tok, vocab):
    p = plan(LLAMA3_TEMPLATE, USER, {}, TOOLS, "auto", True)
    assert p.fmt is LLAMA3 and p.schema.anchored
    c = p.constraint(vocab)
    prose = c.copy()
    feed(prose, ids_of(tok, "A set is written {1, 2}."))   # braces in prose stay free
    assert not prose.triggered and prose.is_complete()
    call = c.copy()
    feed(call, ids_of(tok, " {\"name\": \"get_time\", \"parameters\": {\"zone\": -3}}"))
    assert call.triggered and call.is_complete()
    d = c.copy()
    with pytest.raises(ConstraintError):
        for i in ids_of(tok, "{\"zone"):
            d.advance(i)


def test_mistral_nemo_list_and_copies_are_independent(tok, vocab):
    p = plan(NEMO_TEMPLATE, USER, {}, TOOLS, "auto", False)
    assert p.fmt is MISTRAL_NEMO and p.schema.body["maxItems"] == 1
    c = p.constraint(vocab)
    feed(c, ids_of(tok, "[TOOL_CALLS]"))
    a, b = c.copy(), c.copy()
    feed(a, ids_of(tok, '[{"name": "get_time", "arguments": {"zone": 1}}]'))
    assert a.is_complete() and b.triggered and not b.is_complete()
    assert (b.mask() == c.mask()).all()


def test_other_templates_keep_the_generic_answer():
    generic = plan("{{ messages }}", USER, {}, TOOLS, "required", True)
    assert generic.fmt is GENERIC and generic.schema["required"] == ["tool_calls"]
    assert plan("{{ messages }}", USER, {}, TOOLS, "auto", True).fmt is GENERIC
    # harmony's <|channel|> also opens its analysis and final channels: auto waits for
    # the recipient instead (test_harmony_*)
    assert plan(HARMONY_TEMPLATE, USER, {}, TOOLS, "auto", True).schema.trigger == \
        "to=functions."


# Formats that write the function's name as text: (template, the text before a call under
# auto, free text that must stay free).
SMALL_TEMPLATE = "{% if tools %}[TOOL_CALLS][ARGS]{% endif %}"
R1_TEMPLATE = "{{ tools }}<｜tool▁sep｜>```json"
V31_TEMPLATE = "{{ tools }}<｜tool▁sep｜>"
FUNCTIONARY_TEMPLATE = "{{ tools }}>>>all"
HARMONY_TEMPLATE = "{{ tools }}<|channel|> to= functions."
NAMED = {"mistral": (SMALL_TEMPLATE, MISTRAL, "[TOOL_CALLS]"),
         "deepseek_r1": (R1_TEMPLATE, DEEPSEEK_R1, "<｜tool▁calls▁begin｜>"),
         "deepseek_v31": (V31_TEMPLATE, DEEPSEEK_V31, "<｜tool▁calls▁begin｜>"),
         "functionary_v32": (FUNCTIONARY_TEMPLATE, FUNCTIONARY_V32, "")}


@pytest.mark.parametrize("fmt_name", list(NAMED))
def test_named_formats_random_walks_parse(tok, vocab, fmt_name):
    template, fmt, _ = NAMED[fmt_name]
    p = plan(template, USER, {}, TOOLS, "required", True)
    assert p.fmt is fmt and p.schema.named is not None and not p.schema.trigger
    c = p.constraint(vocab)
    assert not c.allowed(ids_of(tok, "Sure")[0]) and not c.allowed(int(vocab.eog[0]))
    rng = np.random.default_rng(11)
    texts = [t for t in (sample(c.copy(), vocab, rng) for _ in range(10)) if t is not None]
    assert len(texts) >= 5
    for t in texts:
        calls = valid_calls(fmt, t)
        assert calls, t
        _, parsed = fmt.parse(t)
        assert len(parsed) == len(calls)


@pytest.mark.parametrize("fmt_name", ["mistral", "deepseek_r1", "deepseek_v31"])
def test_named_formats_lazy_hold_each_tools_own_arguments(tok, vocab, fmt_name):
    template, fmt, opening = NAMED[fmt_name]
    p = plan(template, USER, {}, TOOLS, "auto", True)
    assert p.schema.trigger == opening
    c = p.constraint(vocab)
    feed(c, ids_of(tok, "Let me check. "))
    assert not c.triggered and c.is_complete()
    head = canonical_text(fmt, [ToolCall("get_time", '{"zone": 3}')])
    cut = head.index('{"zone"')
    feed(c, ids_of(tok, head[:cut]))
    assert c.triggered
    for bad in ['{"city": "Paris"', '{"zone": 15}', '{"zone": "3"}']:
        d = c.copy()
        with pytest.raises(ConstraintError):
            for i in ids_of(tok, bad):
                d.advance(i)
    feed(c, ids_of(tok, head[cut:]))
    assert c.is_complete()
    assert valid_calls(fmt, "Let me check. " + head) == [("get_time", {"zone": 3})]


def test_named_function_in_a_named_format_is_that_function(tok, vocab):
    p = plan(SMALL_TEMPLATE, USER, {}, TOOLS,
             {"type": "function", "function": {"name": "get_weather"}}, True)
    assert list(p.schema.named) == ["get_weather"] and not p.schema.repeat
    c = p.constraint(vocab)
    feed(c, ids_of(tok, "[TOOL_CALLS]get_"))
    d = c.copy()
    with pytest.raises(ConstraintError):
        for i in ids_of(tok, "time"):
            d.advance(i)


def test_functionary_required_opens_with_the_name(tok, vocab):
    # The prompt ends with ">>>": the first call comes without it, later ones with it.
    c = plan(FUNCTIONARY_TEMPLATE, USER, {}, TOOLS, "required", True).constraint(vocab)
    assert not c.allowed(ids_of(tok, ">>>")[0])
    feed(c, ids_of(tok, 'get_time\n{"zone": 1}\n>>>get_weather\n'
                        '{"city": "Rome", "unit": "c"}'))
    assert c.is_complete()
    assert plan(FUNCTIONARY_TEMPLATE, USER, {}, TOOLS, "auto", True).schema is None


# ----------------------------------------------------------------------------- control tokens

# SmolLM2's tokenizer with some of its unused control tokens renamed to the markers that
# are one control token each in Mistral's and DeepSeek's vocabularies.
MARKERS = {3: "[TOOL_CALLS]", 5: "[ARGS]", 6: "<｜tool▁calls▁begin｜>", 7: "<｜tool▁calls▁end｜>",
           8: "<｜tool▁call▁begin｜>", 9: "<｜tool▁call▁end｜>", 10: "<｜tool▁sep｜>"}


@pytest.fixture(scope="module")
def marked_tok(metas):
    meta = dict(metas["smollm"])
    tokens = list(meta["tokenizer.ggml.tokens"])
    for i, text in MARKERS.items():
        tokens[i] = text
    meta["tokenizer.ggml.tokens"] = tokens
    return Tokenizer.from_metadata(meta)


@pytest.fixture(scope="module")
def marked_vocab(marked_tok):
    v = TokenVocab.from_tokenizer(marked_tok)
    assert {t: text for text, t in v.controls if t in MARKERS} == MARKERS
    assert not v.usable[list(MARKERS)].any()
    return v


def sample_ids(c, vocab, rng, cap=400):
    """As sample(), but returns the token ids (the text is the tokenizer's to decode)."""
    eog = int(vocab.eog[0])
    out = []
    for _ in range(cap):
        m = c.mask()
        ok = np.setdiff1d(np.flatnonzero(m), vocab.eog)
        if m[eog] and (not ok.size or rng.random() < 0.5):
            c.advance(eog)
            return out
        w = 1.0 / (1 + (vocab.off[ok + 1] - vocab.off[ok])) ** 3
        t = int(rng.choice(ok, p=w / w.sum()))
        c.advance(t)
        out.append(t)
    return None


def test_a_control_token_trigger_starts_the_lazy_call(marked_tok, marked_vocab):
    c = plan(SMALL_TEMPLATE, USER, {}, TOOLS, "auto", True).constraint(marked_vocab)
    feed(c, ids_of(marked_tok, "Let me check."))
    assert not c.triggered and c.mask()[3]
    c.advance(3)   # the [TOOL_CALLS] token itself
    assert c.triggered
    # the name, then [ARGS] as its token too, never spelled out
    feed(c, ids_of(marked_tok, "get_time"))
    assert c.mask()[5] and not c.allowed(ids_of(marked_tok, "[")[0])
    c.advance(5)
    feed(c, ids_of(marked_tok, '{"zone": 2}'))
    assert c.is_complete()
    text = marked_tok.decode(ids_of(marked_tok, "Let me check.") + [3]
                             + ids_of(marked_tok, "get_time") + [5]
                             + ids_of(marked_tok, '{"zone": 2}'))
    assert valid_calls(MISTRAL, text) == [("get_time", {"zone": 2})]


@pytest.mark.parametrize("fmt_name", ["mistral", "deepseek_v31", "deepseek_r1"])
def test_required_emits_the_control_tokens(marked_tok, marked_vocab, fmt_name):
    template, fmt, _ = NAMED[fmt_name]
    c = plan(template, USER, {}, TOOLS, "required", True).constraint(marked_vocab)
    first = np.flatnonzero(c.mask())
    assert first.tolist() == [3 if fmt_name == "mistral" else 6]
    rng = np.random.default_rng(5)
    runs = [r for r in (sample_ids(c.copy(), marked_vocab, rng) for _ in range(8))
            if r is not None]
    assert len(runs) >= 4
    for ids in runs:
        used = set(ids) & set(MARKERS)
        assert used <= set(MARKERS) and used
        assert valid_calls(fmt, marked_tok.decode(ids))


# ----------------------------------------------------------------------------- tools in prompts

SUITE_TEMPLATES = vocab_suite_dir() / "templates"


@pytest.mark.parametrize("name", ["deepseek-ai-DeepSeek-V3.1.jinja",
                                  "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"])
def test_templates_that_never_render_tools_get_them_in_a_system_message(name):
    path = SUITE_TEMPLATES / name
    if not path.is_file():
        pytest.skip("no templates: `python scripts/fetch_models.py --vocab-suite`")
    src = path.read_text()
    assert "tools" not in src
    p = plan(src, [{"role": "system", "content": "Be brief."}] + USER, {}, TOOLS, "auto", True)
    fmt = p.fmt
    assert fmt in (DEEPSEEK_V31, DEEPSEEK_R1) and p.schema.trigger
    prompt = ChatTemplate(src, name, bos_token="<s>").render(p.messages, **p.template_kwargs)
    assert "Be brief." in prompt and '"get_weather"' in prompt and '"get_time"' in prompt
    assert WEATHER["function"]["description"] in prompt and '"maxLength": 12' in prompt
    example = canonical_text(fmt, [ToolCall("get_weather", '{"city": "...", "unit": "c"}')])
    assert example in prompt
    # a template that renders the tools itself gets no such message
    assert plan(HERMES_TEMPLATE, USER, {}, TOOLS, "auto", True).messages == USER
    # tool_choice none: no tools offered, no message
    assert plan(src, USER, {}, TOOLS, "none", True).messages == USER


# ----------------------------------------------------------------------------- XML calls

QWEN3_CODER_TEMPLATE = "{{ tools }}<tool_call><function=x><parameter=y>"
GLM_TEMPLATE = "{{ tools }}<tool_call><arg_key><arg_value>"
XML = {"qwen3_coder": (QWEN3_CODER_TEMPLATE, QWEN3_CODER), "glm": (GLM_TEMPLATE, GLM)}
# a free string (raw text up to the closing tag), an optional JSON array and integer
NOTE_PARAMS = {"type": "object",
               "properties": {"text": {"type": "string"},
                              "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                       "maxItems": 2},
                              "level": {"type": "integer", "minimum": 0, "maximum": 9}},
               "required": ["text"]}
NOTE = {"type": "function", "function": {"name": "note", "parameters": NOTE_PARAMS}}
XML_TOOLS = [WEATHER, TIME, NOTE]
XML_PARAMS = dict(PARAMS, note=NOTE_PARAMS)


def xml_calls(fmt: ToolFormat, text: str) -> list[tuple[str, dict]]:
    """The XML calls in text (typed by the tools), each checked against its tool's schema."""
    _, calls = fmt.parse(text, XML_TOOLS)
    out = []
    for c in calls:
        args = json.loads(c.arguments)
        Draft202012Validator(XML_PARAMS[c.name]).validate(args)
        out.append((c.name, args))
    return out


def test_xml_string_value_is_text_without_the_closing_tag():
    from localllm.generation.constrain.json_grammar import JsonGrammar
    from localllm.generation.constrain.xml_calls import text_without
    g = JsonGrammar()
    cg = g.compile(g.seq([text_without(g, "</parameter>")] + lit("\n</parameter>")))
    for ok in ["", "a < b", "<<</param\n", "x</parameterX", "</parameter", "<", "</"]:
        assert cg.matches(ok + "\n</parameter>"), ok
    for bad in ["</parameter>", "a<</parameter>b", "x\n</parameter>y"]:
        assert not cg.matches(bad + "\n</parameter>"), bad


@pytest.mark.parametrize("fmt_name", list(XML))
def test_xml_required_random_walks_validate(tok, vocab, fmt_name):
    template, fmt = XML[fmt_name]
    # (a free string seldom ends by chance: note's walks are test_xml_free_text_walks')
    p = plan(template, USER, {}, TOOLS, "required", True)
    assert p.fmt is fmt and p.schema.xml == fmt_name and not p.schema.trigger
    c = p.constraint(vocab)
    assert not c.allowed(ids_of(tok, "Sure")[0]) and not c.allowed(int(vocab.eog[0]))
    rng = np.random.default_rng(17)
    texts = [t for t in (sample(c.copy(), vocab, rng, cap=600) for _ in range(12))
             if t is not None]
    assert len(texts) >= 6
    names = set()
    for t in texts:
        calls = xml_calls(fmt, t)
        assert calls and fmt.parse(t, XML_TOOLS)[0] == "", t
        names |= {n for n, _ in calls}
    assert len(names) >= 2


@pytest.mark.parametrize("fmt_name", list(XML))
def test_xml_free_text_walks(tok, vocab, fmt_name):
    # random tokens inside a free string parameter, then its closing tag, then random again
    template, fmt = XML[fmt_name]
    c = plan(template, USER, {}, [NOTE], "required", False).constraint(vocab)
    head = canonical_text(fmt, [ToolCall("note", '{"text": "VALUE"}')])
    head = head[:head.index("VALUE")]
    close = "\n</parameter>" if fmt_name == "qwen3_coder" else "</arg_value>"
    feed(c, ids_of(tok, head))
    rng = np.random.default_rng(29)
    done = 0
    for _ in range(6):
        d = c.copy()
        body = []
        for _ in range(int(rng.integers(1, 40))):
            ok = np.setdiff1d(np.flatnonzero(d.mask()), vocab.eog)
            t = int(rng.choice(ok))
            d.advance(t)
            body.append(vocab.token_bytes(t))
        try:
            value = b"".join(body).decode()
        except UnicodeDecodeError:
            continue   # it stopped inside a character
        if close in value:
            continue   # the walk closed the value itself
        text = head + value
        feed(d, ids_of(tok, close))
        rest = sample(d, vocab, rng, cap=300)
        if rest is None:
            continue
        done += 1
        text += close + rest
        (name, args), = xml_calls(fmt, text)
        assert name == "note" and args["text"] == value
    assert done >= 3


@pytest.mark.parametrize("fmt_name", list(XML))
def test_xml_auto_is_free_until_the_tag_then_held(tok, vocab, fmt_name):
    template, fmt = XML[fmt_name]
    p = plan(template, USER, {}, XML_TOOLS, "auto", True)
    assert p.schema.trigger == "<tool_call>"
    c = p.constraint(vocab)
    feed(c, ids_of(tok, "Let me check the <b>time</b>. "))
    assert not c.triggered and c.is_complete()
    call = canonical_text(fmt, [ToolCall("get_time", '{"zone": 3}')])
    cut = call.index("zone")
    feed(c, ids_of(tok, call[:cut]))
    assert c.triggered
    for bad in ["city", "zone>\n15" if fmt_name == "qwen3_coder" else "zone</arg_key>\n"
                "<arg_value>15"]:
        d = c.copy()
        with pytest.raises(ConstraintError):
            for i in ids_of(tok, bad):
                d.advance(i)
    feed(c, ids_of(tok, call[cut:]))
    assert c.is_complete()
    rng = np.random.default_rng(23)
    done = 0
    walks = plan(template, USER, {}, TOOLS, "auto", True).constraint(vocab)
    for _ in range(8):
        d = walks.copy()
        feed(d, ids_of(tok, "Checking. <tool_call>"))
        text = sample(d, vocab, rng, cap=600)
        if text is not None:
            done += 1
            assert xml_calls(fmt, "Checking. <tool_call>" + text)
    assert done >= 4


def test_xml_named_function_and_required_parameters(tok, vocab):
    p = plan(QWEN3_CODER_TEMPLATE, USER, {}, XML_TOOLS,
             {"type": "function", "function": {"name": "get_weather"}}, True)
    assert list(p.schema.named) == ["get_weather"] and not p.schema.repeat
    c = p.constraint(vocab)
    feed(c, ids_of(tok, "<tool_call>\n<function=get_weather>\n"))
    d = c.copy()
    with pytest.raises(ConstraintError):   # city is required: the call cannot end yet
        for i in ids_of(tok, "</function>"):
            d.advance(i)
    # a string with maxLength is counted text: at most 12 characters
    feed(c, ids_of(tok, "<parameter=city>\nParis\n</parameter>\n"))
    d = c.copy()
    with pytest.raises(ConstraintError):
        for i in ids_of(tok, "<parameter=unit>\nk"):
            d.advance(i)
    feed(c, ids_of(tok, "<parameter=unit>\nf\n</parameter>\n</function>\n</tool_call>"))
    assert c.is_complete()


# ----------------------------------------------------------------------------- harmony

# As in gpt-oss's vocabulary: the markers are tokens of their own that the tokenizer renders
# as text (user-defined), beside <|return|> and <|call|>, which end generation.
HARMONY_MARKERS = {3: "<|channel|>", 5: "<|message|>", 6: "<|constrain|>", 7: "<|start|>",
                   8: "<|end|>", 9: "<|return|>", 10: "<|call|>"}
CTL = {3: "<|channel|>", 5: "<|message|>", 6: "<|constrain|>", 7: "<|start|>"}


@pytest.fixture(scope="module")
def harmony_tok(metas):
    meta = dict(metas["smollm"])
    tokens = list(meta["tokenizer.ggml.tokens"])
    for i, text in HARMONY_MARKERS.items():
        tokens[i] = text
    meta["tokenizer.ggml.tokens"] = tokens
    return Tokenizer.from_metadata(meta)


@pytest.fixture(scope="module")
def harmony_vocab(harmony_tok):
    v = TokenVocab.from_tokenizer(harmony_tok)
    assert v.usable[list(CTL) + [8]].all() and {9, 10} <= set(v.eog.tolist())
    return v


def test_harmony_required_is_analysis_then_a_call(harmony_tok, harmony_vocab):
    p = plan(HARMONY_TEMPLATE, USER, {}, TOOLS, "required", True)
    assert p.fmt is HARMONY and p.schema.lead
    c = p.constraint(harmony_vocab)
    m = c.mask()
    assert m[3] and not m[ids_of(harmony_tok, "Sure")[0]]   # <|channel|> (its token) first
    rng = np.random.default_rng(31)
    runs = [r for r in (sample_ids(c.copy(), harmony_vocab, rng, cap=500) for _ in range(10))
            if r is not None]
    assert len(runs) >= 5
    leads = 0
    for ids in runs:
        text = harmony_tok.decode(ids)
        leads += text.startswith("<|channel|>analysis")
        _, calls = HARMONY.parse(text)
        assert len(calls) == 1, text
        Draft202012Validator(PARAMS[calls[0].name]).validate(json.loads(calls[0].arguments))
    named = plan(HARMONY_TEMPLATE, USER, {}, TOOLS,
                 {"type": "function", "function": {"name": "get_time"}}, True)
    d = named.constraint(harmony_vocab)
    feed(d, [3] + ids_of(harmony_tok, "commentary to=functions.get_"))
    with pytest.raises(ConstraintError):
        for i in ids_of(harmony_tok, "weather"):
            d.advance(i)


def test_harmony_auto_leaves_analysis_and_final_free(harmony_tok, harmony_vocab):
    p = plan(HARMONY_TEMPLATE, USER, {}, TOOLS, "auto", True)
    c = p.constraint(harmony_vocab)
    free = c.copy()
    feed(free, [3] + ids_of(harmony_tok, "analysis") + [5]
         + ids_of(harmony_tok, "Need the time.") + [8, 7]
         + ids_of(harmony_tok, "assistant") + [3] + ids_of(harmony_tok, "final") + [5]
         + ids_of(harmony_tok, "It is noon."))
    assert not free.triggered and free.is_complete()
    feed(c, [3] + ids_of(harmony_tok, "commentary to=functions."))
    assert c.triggered
    feed(c, ids_of(harmony_tok, "get_time "))
    assert c.mask()[6]   # <|constrain|>, its token
    c.advance(6)
    feed(c, ids_of(harmony_tok, "json") + [5])
    d = c.copy()
    with pytest.raises(ConstraintError):
        for i in ids_of(harmony_tok, '{"zone": 15'):
            d.advance(i)
    feed(c, ids_of(harmony_tok, '{"zone": 2}'))
    assert c.is_complete()
    text = harmony_tok.decode([3] + ids_of(harmony_tok, "commentary to=functions.get_time ")
                              + [6] + ids_of(harmony_tok, "json") + [5]
                              + ids_of(harmony_tok, '{"zone": 2}'))
    assert [(x.name, json.loads(x.arguments)) for x in HARMONY.parse(text)[1]] == \
        [("get_time", {"zone": 2})]
