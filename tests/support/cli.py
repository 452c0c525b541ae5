"""The `llm` command run as a user runs it: a real process of this Python."""

import os
import subprocess
import sys

LLM = [sys.executable, "-m", "localllm.apps.cli"]


def llm(*args, stdin=None, timeout=300):
    """Run `llm ARGS...`; returns the CompletedProcess (text stdout and stderr)."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(LLM + list(args), input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)
