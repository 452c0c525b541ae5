"""Chat templates are untrusted code from the model file: a corpus of known attacks
(sandbox escapes, time and memory bombs) must each fail with one clear TemplateError, and
real templates must render as before under the limits."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import jinja2.ext
import jinja2.sandbox
import pytest

from localllm.text.chat_template import BUILTIN_TEMPLATES, ChatTemplate, TemplateError
from localllm.text.template_guard import RenderLimits

DOC = json.loads((Path(__file__).parents[1] / "fixtures" / "templates" / "attacks.json")
                 .read_text(encoding="utf-8"))
ATTACKS = {a["name"]: a for a in DOC["attacks"]}
# Short, so the time bombs cost CI half a second each; the sizes are the defaults. An attack
# that a size cap must stop gets time enough for the cap to trip first on a loaded machine.
LIMITS = RenderLimits(seconds=0.5)
SIZE_LIMITS = RenderLimits(seconds=30.0)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
HANG = 60.0  # a guard against a hang, not a speed assertion


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_fails_with_a_clear_error(tmp_path, name):
    attack = ATTACKS[name]
    marker = tmp_path / "pwned"
    source = attack["source"].replace("MARKER", str(marker))
    t0 = time.perf_counter()
    with pytest.raises(TemplateError) as err:
        limits = LIMITS if "longer than" in attack["needle"] else SIZE_LIMITS
        ChatTemplate(source, "file", limits=limits).render(MESSAGES)
    assert time.perf_counter() - t0 < HANG
    message = str(err.value)
    assert attack["needle"] in message and "\n" not in message, message
    assert not marker.exists()


def test_time_limit_is_the_one_asked_for():
    source = ATTACKS["nested loops, empty body"]["source"]
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match="longer than 0.2 s"):
        ChatTemplate(source, "file", limits=RenderLimits(seconds=0.2)).render(MESSAGES)
    assert time.perf_counter() - t0 < HANG


def test_limits_hold_per_rendering_and_per_thread():
    # Each rendering gets its own clock and counters: a template that builds 6 MiB per
    # rendering renders many times, and from several threads at once.
    tmpl = ChatTemplate("{{ 'a' * (6 * 2**20) }}{{ messages[-1].content }}", "file")
    results, errors = [], []

    def work():
        try:
            for _ in range(3):
                results.append(len(tmpl.render(MESSAGES)))
        except Exception as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [6 * 2**20 + 3] * 12


def test_output_and_string_caps_are_configurable():
    small = RenderLimits(max_chars=1000)
    tmpl = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", "file", limits=small)
    assert tmpl.render([{"role": "user", "content": "x" * 900}]) == "x" * 900
    with pytest.raises(TemplateError, match="the rendered prompt would hold more than 1000"):
        tmpl.render([{"role": "user", "content": "x" * 600}] * 2)


def test_large_real_conversations_render(metas):
    """A conversation of a megabyte renders under the default limits with both models'
    own templates and every builtin."""
    long = [{"role": "system", "content": "Be brief."}] + [
        {"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + "word " * 1000}
        for i in range(200)]
    templates = [ChatTemplate.resolve(m) for m in metas.values()]
    templates += [ChatTemplate.resolve({}, override=name) for name in sorted(BUILTIN_TEMPLATES)]
    for tmpl in templates:
        text = tmpl.render(long)
        assert text.count("word") == 200 * 1000 and "turn 199 " in text, tmpl.name


def test_guarded_rendering_matches_plain_jinja():
    # The guards wrap every loop's items and every '~'; loop variables, loop filters, else,
    # recursion and the guarded operators render exactly as in jinja's own sandbox.
    src = ("{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}"
           "{{ '' if loop.last else ',' }}{% else %}none{% endfor %}|"
           "{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}({{ loop(x) }})"
           "{% else %}{{ x }}{% endif %}{% endfor %}|{{ 'a' ~ 1 ~ none }}|{{ (range(3)|list) * 2 }}"
           "|{{ '%5s|%-3d' % ('ab', 7) }}|{{ '{:>4}'.format('x') }}|{{ ['a', 'b']|join('-') }}")
    plain = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    for messages in (MESSAGES + [{"role": "user", "content": "again"}], []):
        want = plain.from_string(src).render(messages=messages)
        assert ChatTemplate(src, "file").render(messages, add_generation_prompt=False) == want
    assert want == "none|(1(2))(3)|a1None|[0, 1, 2, 0, 1, 2]|   ab|7  |   x|a-b"
