"""`llm run` with a model that reasons: the thinking goes to stderr (plain when stderr is
not a terminal), the answer to stdout, and --hide-reasoning drops the thinking."""

from pathlib import Path

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
