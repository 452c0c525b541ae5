"""What `llm run` and `llm serve` show besides the answer: the line of a first run's kernel
compile, and a reasoning model's thinking on stderr (dimmed on a terminal) with the answer
on stdout."""

from __future__ import annotations

import sys
import time

from localllm.text.reasoning import Part


class CompileLine:
    """The stderr line shown while a first run compiles kernels: rewritten in place with the
    elapsed time on a terminal, one line per finished group otherwise."""

    def __init__(self):
        self.start = time.perf_counter()
        self.shown = -1

    def __call__(self, done: int, total: int) -> None:
        if done == total == self.shown:
            return
        text = (f"compiling kernels for this CPU (first run only): {done}/{total}, "
                f"{time.perf_counter() - self.start:.0f} s")
        if sys.stderr.isatty():
            sys.stderr.write("\r" + text + ("\n" if done == total else ""))
        elif done != self.shown:
            sys.stderr.write(text + "\n")
        self.shown = done
        sys.stderr.flush()


class ReasoningOut:
    """Reasoning on stderr, dimmed where stderr is a terminal, ended by a line break."""

    DIM, RESET = "\x1b[2m", "\x1b[0m"

    def __init__(self, err, hide: bool):
        """Args:
            err: the stream (stderr).
            hide: drop the thinking (--hide-reasoning).
        """
        self.err, self.hide, self.open = err, hide, False
        self.tty = err.isatty()

    def write(self, text: str) -> None:
        if self.hide or not text:
            return
        self.open = True
        self.err.write(f"{self.DIM}{text}{self.RESET}" if self.tty else text)
        self.err.flush()

    def end(self) -> None:
        if self.open:
            self.err.write("\n")
            self.err.flush()
            self.open = False


def write_parts(parts: list[Part], out, shown: ReasoningOut) -> None:
    """Write split output: the answer (and any harmony call) to ``out``, the thinking to
    ``shown``.

    Args:
        parts: from a ReasoningSplitter.
        out: the answer's stream (stdout).
        shown: where the thinking goes.
    """
    for p in parts:
        if p.kind == "reasoning":
            shown.write(p.text)
            continue
        shown.end()
        # a harmony message to a function, as written (llm run has no tools to call)
        out.write(p.text if p.kind == "content" else f"{p.name} {p.text}")
        out.flush()
