"""The reasoning splitter: <think> tags and harmony channels, whole and fed piece by piece
(every cut of the text gives the same parts, and nothing is held back but a marker's start)."""

from __future__ import annotations

import random

import pytest

from localllm.text.reasoning import (Part, ReasoningSplitter, split_reasoning,
                                     style_of_template)

R1 = "<think>\nThe user asks for 2+2.\nThat is 4.\n</think>\n\nThe answer is 4."
HARMONY = ("<|channel|>analysis<|message|>User wants a sum. 2+2=4.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.")
HARMONY_TOOL = ("<|channel|>analysis<|message|>Need the weather.<|end|>"
                "<|start|>assistant<|channel|>commentary to=functions.get_weather "
                "<|constrain|>json<|message|>{\"city\":\"Paris\"}<|call|>")


def fed(text: str, cuts: list[int], style: str = "think", prompt: str = "") -> list[Part]:
    sp = ReasoningSplitter(style, prompt)
    parts, last = [], 0
    for c in cuts + [len(text)]:
        parts += sp.feed(text[last:c])
        last = c
    return parts + sp.finish()


def joined(parts: list[Part]) -> tuple[str, str, list]:
    return ("".join(p.text for p in parts if p.kind == "reasoning"),
            "".join(p.text for p in parts if p.kind == "content"),
            [(p.name, p.text) for p in parts if p.kind == "tool_call"])


def every_cut_agrees(text: str, style: str = "think", prompt: str = "") -> tuple:
    whole = joined(fed(text, [], style, prompt))
    for i in range(len(text) + 1):               # every single cut
        assert joined(fed(text, [i], style, prompt)) == whole, i
    assert joined(fed(text, list(range(1, len(text))), style, prompt)) == whole  # by chars
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        assert joined(fed(text, cuts, style, prompt)) == whole
    return whole


def test_think_tags_split_and_trim():
    assert every_cut_agrees(R1) == ("The user asks for 2+2.\nThat is 4.", "The answer is 4.", [])
    s = split_reasoning(R1)
    assert (s.reasoning, s.content) == ("The user asks for 2+2.\nThat is 4.", "The answer is 4.")


def test_mistral_think_tags_split_however_cut():
    text = "[THINK]The user asks for 2+2.\nThat is 4.[/THINK]\n\nThe answer is 4."
    assert every_cut_agrees(text, "mistral") == (
        "The user asks for 2+2.\nThat is 4.", "The answer is 4.", [])
    assert every_cut_agrees("4 [THINK] is a tag", "mistral") == ("", "4 [THINK] is a tag", [])
    assert every_cut_agrees("a[/THINK]b", "mistral", prompt="[INST]q[/INST][THINK]") == (
        "a", "b", [])


def test_no_tags_is_all_content_and_streams_at_once():
    assert every_cut_agrees("Hello <b>there</b>") == ("", "Hello <b>there</b>", [])
    sp = ReasoningSplitter("think")
    assert sp.feed("Hi") == [Part("content", "Hi")]
    assert sp.feed(" <think>x") == [Part("content", " <think>x")]   # only at the start


def test_partial_open_tag_is_held_until_it_resolves():
    sp = ReasoningSplitter("think")
    assert sp.feed("\n<thi") == []
    assert sp.feed("s is text") == [Part("content", "\n<this is text")]


def test_template_that_opens_think_starts_inside_reasoning():
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    text = "Let me think.\n</think>\n\nHello!"
    assert every_cut_agrees(text, prompt=prompt) == ("Let me think.", "Hello!", [])
    # DeepSeek R1 distills put the tag after their own assistant marker
    assert split_reasoning("a</think>b", prompt="<｜Assistant｜><think>\n").reasoning == "a"
    # thinking switched off: the template closed the block itself
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert split_reasoning("Hello", prompt=closed).content == "Hello"


def test_reasoning_streams_but_holds_a_partial_close_and_trailing_space():
    sp = ReasoningSplitter("think", "<think>")
    assert sp.feed("\nstep one") == [Part("reasoning", "step one")]
    assert sp.feed(" and\n</th") == [Part("reasoning", " and")]   # "\n</th" waits
    assert sp.in_reasoning
    assert sp.feed("ink>\n\nDone") == [Part("content", "Done")]
    assert not sp.in_reasoning


def test_unclosed_reasoning_and_empty_reasoning():
    assert split_reasoning("<think>still going ").reasoning == "still going"
    assert split_reasoning("<think>\n\n</think>\n\nAnswer") == split_reasoning("Answer")
    assert split_reasoning("<think></think>").content == ""


def test_harmony_channels():
    assert style_of_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"
    assert style_of_template("{{ '<|im_start|>' }}") == "think"
    prompt = "<|start|>user<|message|>2+2?<|end|><|start|>assistant"
    got = every_cut_agrees(HARMONY, "harmony", prompt)
    assert got == ("User wants a sum. 2+2=4.", "2 + 2 = 4.", [])
    # a final message ended by <|return|> (its text when special tokens are shown)
    assert every_cut_agrees(HARMONY + "<|return|>", "harmony", prompt) == got


def test_harmony_tool_call_is_returned_apart():
    got = every_cut_agrees(HARMONY_TOOL, "harmony", "<|start|>assistant")
    assert got == ("Need the weather.", "", [("functions.get_weather", '{"city":"Paris"}')])
    # recipient in the role header, the other placement gpt-oss uses
    text = "<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}<|call|>"
    assert split_reasoning(text, "harmony").tool_calls == [Part("tool_call", "{}",
                                                                "functions.f")]


def test_harmony_preamble_is_content_and_prompt_opened_channel():
    text = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    assert split_reasoning(text, "harmony").content == "Checking.Done."
    opened = "<|start|>assistant<|channel|>analysis<|message|>"
    got = split_reasoning("hmm<|end|><|start|>assistant<|channel|>final<|message|>ok",
                          "harmony", opened)
    assert (got.reasoning, got.content) == ("hmm", "ok")


def test_harmony_turns_of_other_roles_are_dropped():
    text = HARMONY + "<|end|><|start|>user<|message|>Thanks!<|end|>"
    assert every_cut_agrees(text, "harmony", "<|start|>assistant") == (
        "User wants a sum. 2+2=4.", "2 + 2 = 4.", [])


def test_harmony_without_markup_falls_back_to_content():
    assert every_cut_agrees("Just text.", "harmony", "<|start|>assistant") == ("", "Just text.", [])
    assert split_reasoning("", "harmony", "<|start|>assistant") == split_reasoning("")


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning style"):
        ReasoningSplitter("xml")


R7B = ('<|START_THINKING|>I will look up the weather in Paris.<|END_THINKING|><|START_ACTION|>[\n'
       '    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}\n'
       ']<|END_ACTION|>')


def test_command_r7b_plan_is_reasoning():
    from localllm.text.tool_calls import COMMAND_R7B
    src = ("{% if not enable_thinking %}<|START_THINKING|><|END_THINKING|>{% endif %}"
           "<|START_ACTION|>{{ tools }}")
    assert style_of_template(src) == "cohere"
    assert style_of_template("<think>" + src) == "think"
    reasoning, content, _ = every_cut_agrees(R7B, "cohere")
    assert reasoning == "I will look up the weather in Paris."
    assert content.startswith("<|START_ACTION|>")
    assert [(c.name, c.arguments) for c in COMMAND_R7B.parse(content)[1]] == \
        [("get_weather", '{"city": "Paris"}')]
    # thinking off: the prompt closes an empty plan, the answer is content
    answer = "<|START_RESPONSE|>Hi there.<|END_RESPONSE|>"
    assert joined(fed(answer, [], "cohere", "<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>")) \
        == ("", answer, [])
