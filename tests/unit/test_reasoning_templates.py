"""Reasoning models' own chat templates (the copies llama.cpp ships, in
tests/fixtures/templates/): SmolLM3's ``/think`` and ``/no_think`` in the system prompt and
``enable_thinking`` pick the reasoning mode; Ministral 3's reasoning is in [THINK] tags; the
output splits into reasoning and answer from the rendered prompt."""

from __future__ import annotations

from pathlib import Path

import pytest

from localllm.text.chat_template import ChatTemplate
from localllm.text.reasoning import split_reasoning, style_of_template

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "templates"
SOURCE = (TEMPLATES / "smollm3.jinja").read_text()
HEAD = "<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n"
CLOSED = "<|im_start|>assistant\n<think>\n\n</think>\n"   # the no-think generation prompt
DEFAULT_NO_THINK = "You are a helpful AI assistant named SmolLM, trained by Hugging Face.\n\n"


@pytest.fixture(scope="module")
def tmpl():
    return ChatTemplate(SOURCE, "smollm3")


def render(tmpl, system=None, **kw):
    msgs = [{"role": "system", "content": system}] if system is not None else []
    msgs += [{"role": "user", "content": "What is 5+5?"},
             {"role": "assistant", "content": "10"},
             {"role": "user", "content": "And 6+6?"}]
    return tmpl.render(msgs, **kw)


def test_thinking_is_the_default(tmpl):
    p = render(tmpl)
    assert p.startswith(HEAD + "Reasoning Mode: /think\n\n## Custom Instructions\n\n"
                               "You are a helpful AI assistant named SmolLM")
    assert "Thought section" in p                 # the long default system prompt of /think
    assert p.endswith("<|im_start|>user\nAnd 6+6?<|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>assistant\n10<|im_end|>\n" in p   # history as written


@pytest.mark.parametrize("system, kw, mode, instructions", [
    ("Be brief. /no_think", {}, "/no_think", "Be brief.\n\n"),
    ("/no_think", {}, "/no_think", DEFAULT_NO_THINK),
    (None, {"enable_thinking": False}, "/no_think", DEFAULT_NO_THINK),
    ("Be brief. /think", {"enable_thinking": False}, "/think", "Be brief.\n\n"),  # the flag wins
    ("Be brief.", {}, "/think", "Be brief.\n\n"),
])
def test_mode_from_the_system_prompt_and_enable_thinking(tmpl, system, kw, mode, instructions):
    """The flag in the system prompt picks the mode and is cut from the instructions."""
    p = render(tmpl, system, **kw)
    assert p.startswith(HEAD + f"Reasoning Mode: {mode}\n\n## Custom Instructions\n\n"
                        + instructions + "<|im_end|>\n<|im_start|>user\nWhat is 5+5?")
    if mode == "/no_think":
        # earlier answers and the generation prompt carry an empty, closed reasoning block
        assert "<|im_start|>assistant\n<think>\n\n</think>\n10<|im_end|>\n" in p
        assert p.endswith(CLOSED)
    else:
        assert p.endswith("<|im_start|>assistant\n")


def test_output_splits_into_reasoning_and_answer(tmpl):
    assert style_of_template(SOURCE) == "think"
    think = render(tmpl)
    out = "<think>\nSix plus six is twelve.\n</think>\n12"
    s = split_reasoning(out, prompt=think)
    assert (s.reasoning, s.content) == ("Six plus six is twelve.", "12")
    # /no_think: the template closed the block, so all the output is the answer
    s = split_reasoning("12", prompt=render(tmpl, "/no_think"))
    assert (s.reasoning, s.content) == ("", "12")


def test_ministral3_reasoning_template_and_its_think_tags():
    source = (TEMPLATES / "ministral3-reasoning.jinja").read_text()
    assert style_of_template(source) == "mistral"
    t = ChatTemplate(source, "ministral3", bos_token="<s>", eos_token="</s>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "5+5?"},
            {"role": "assistant", "content": "10"}, {"role": "user", "content": "6+6?"}]
    assert t.render(msgs) == ("<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]5+5?[/INST]"
                              "10</s>[INST]6+6?[/INST]")
    assert "[THINK]Your thoughts" in t.render(msgs[1:])    # the default system prompt
    s = split_reasoning("[THINK]Six and six make twelve.[/THINK]12", "mistral", t.render(msgs))
    assert (s.reasoning, s.content) == ("Six and six make twelve.", "12")
    # <think> means nothing to this style, and [THINK] nothing to the other
    assert split_reasoning("<think>a</think>b", "mistral").content == "<think>a</think>b"
    assert split_reasoning("[THINK]a[/THINK]b").content == "[THINK]a[/THINK]b"
