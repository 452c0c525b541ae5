"""`llm run` with a model that reasons: the thinking goes to stderr (plain when stderr is
not a terminal), the answer to stdout, and --hide-reasoning drops the thinking."""

import io
from pathlib import Path

from localllm.apps.run_output import ReasoningOut, write_parts
from localllm.text.reasoning import Part
from support.cli import llm

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "templates" / "think-open.jinja"
COMPILING = "compiling kernels for this CPU"


def run(path, *extra):
    r = llm("run", str(path), "--chat-template", str(TEMPLATE), "-p", "What is 5+5?",
            "-n", "30", "--temp", "0", *extra)
    assert r.returncode == 0, r.stderr
    return r.stdout, "\n".join(x for x in r.stderr.splitlines() if not x.startswith(COMPILING))


def test_reasoning_on_stderr_or_hidden(smollm_path):
    # the template opens <think>; greedy, SmolLM2 answers inside it and ends its turn there
    out, err = run(smollm_path)
    assert out == "\n"
    assert err == "The answer is 15."          # not a terminal: no ANSI dimming
    out, err = run(smollm_path, "--hide-reasoning")
    assert (out, err) == ("\n", "")
    # the model's own template does not reason: everything is the answer, on stdout
    r = llm("run", str(smollm_path), "-p", "What is 5+5?", "-n", "8", "--temp", "0")
    assert r.returncode == 0 and r.stdout.strip()
    assert not [x for x in r.stderr.splitlines() if not x.startswith(COMPILING)]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_thinking_is_dimmed_only_on_a_terminal():
    parts = [Part("reasoning", "hmm"), Part("reasoning", " ok"), Part("content", "4")]
    for err, want in ((Terminal(), "\x1b[2mhmm\x1b[0m\x1b[2m ok\x1b[0m\n"),
                      (io.StringIO(), "hmm ok\n")):
        out = io.StringIO()
        shown = ReasoningOut(err, hide=False)
        write_parts(parts, out, shown)
        shown.end()
        assert (out.getvalue(), err.getvalue()) == ("4", want)
