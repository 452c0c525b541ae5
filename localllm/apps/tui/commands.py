"""Slash commands: their table, parsing with a one-line hint for a mistyped or unknown one,
and ``/set`` values checked against the sampler's own validation."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from localllm.generation.sampling import SamplingParams

# name -> (usage, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "help": ("/help", "commands and keys"),
    "clear": ("/clear", "start a new conversation (this one stays saved)"),
    "system": ("/system [TEXT|off]", "show, set or remove the system prompt"),
    "regen": ("/regen", "write the last reply again, as a new branch"),
    "edit": ("/edit [N]", "edit your Nth message (default: the last); sending makes a branch"),
    "branch": ("/branch [K|next|prev]", "list branch points, or switch the last one to branch K"),
    "set": ("/set NAME VALUE", "sampling: temp top_p top_k min_p seed max_tokens repeat_penalty"),
    "save": ("/save FILE", "write the conversation, every branch, as JSON"),
    "load": ("/load FILE", "open a conversation saved with /save"),
    "export": ("/export FILE", "Markdown of this branch (.md), or JSON of all (.json)"),
    "copy": ("/copy [code] [N]", "copy reply N (default: the last), or its code blocks"),
    "drop": ("/drop N", "leave the N oldest turns out of the context (/drop 0: none)"),
    "summary": ("/summary", "summarize this branch and start a new one from the summary"),
    "stats": ("/stats", "figures of the last reply, the context and the model"),
    "quit": ("/quit", "quit (the conversation is already saved)"),
}

# /set names -> SamplingParams field
SET_NAMES: dict[str, str] = {
    "temp": "temperature", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "seed": "seed", "max_tokens": "max_tokens", "n": "max_tokens",
    "repeat_penalty": "repeat_penalty",
}
_INT_FIELDS = {"top_k", "seed", "max_tokens"}


class CommandError(ValueError):
    """A one-line hint for the user."""


@dataclass
class Command:
    name: str
    args: str


def is_command(text: str) -> bool:
    """Text starting with one slash is a command; ``//`` sends a message that starts with /."""
    s = text.lstrip()
    return s.startswith("/") and not s.startswith("//")


def parse(text: str) -> Command:
    """Split ``/name args``.

    Raises:
        CommandError: unknown command, with the nearest known one when there is one.
    """
    s = text.strip()[1:]
    name, _, args = s.partition(" ")
    name = name.strip().lower()
    if name in COMMANDS:
        return Command(name, args.strip())
    close = difflib.get_close_matches(name, COMMANDS, n=1, cutoff=0.6)
    hint = f"did you mean {COMMANDS[close[0]][0]}? " if close else ""
    raise CommandError(f"unknown command /{name}: {hint}(/help lists them; // sends a "
                       "message starting with /)")


def usage(name: str) -> str:
    u, what = COMMANDS[name]
    return f"usage: {u} — {what}"


def parse_set(args: str, current: dict) -> tuple[str, object]:
    """``/set NAME VALUE`` to (SamplingParams field, value), validated.

    Args:
        args: the text after /set.
        current: the sampling settings now (to validate the new value among them).
    Raises:
        CommandError: a one-line hint.
    """
    parts = args.split()
    if len(parts) != 2:
        raise CommandError(usage("set"))
    name, raw = parts[0].lower(), parts[1]
    if name not in SET_NAMES:
        close = difflib.get_close_matches(name, SET_NAMES, n=1, cutoff=0.5)
        hint = f" — did you mean {close[0]}?" if close else ""
        raise CommandError(f"/set: unknown setting {name!r}{hint} (known: "
                           f"{', '.join(k for k in SET_NAMES if k not in ('temperature', 'n'))})")
    key = SET_NAMES[name]
    value: object
    if key == "seed" and raw.lower() in ("random", "none", "-1"):
        value = None
    elif key in _INT_FIELDS:
        try:
            value = int(raw)
        except ValueError:
            raise CommandError(f"/set {name}: {raw!r} is not a whole number") from None
    else:
        try:
            value = float(raw)
        except ValueError:
            raise CommandError(f"/set {name}: {raw!r} is not a number") from None
        if not math.isfinite(value):
            raise CommandError(f"/set {name}: {raw!r} is not a finite number")
    if key == "max_tokens" and value < 0:
        value = -1   # until end of text or a full context
    trial = {k: v for k, v in current.items() if k in SamplingParams.__dataclass_fields__}
    trial[key] = value
    if trial.get("max_tokens", 0) < 0:
        trial["max_tokens"] = 0
    try:
        SamplingParams(**trial).validate()
    except ValueError as e:
        raise CommandError(f"/set {name}: {e}") from None
    return key, value


def parse_index(args: str, name: str, allow: tuple[str, ...] = ()) -> int | str | None:
    """A command's optional positive number (or one of ``allow``'s words).

    Raises:
        CommandError: anything else.
    """
    a = args.strip().lower()
    if not a:
        return None
    if a in allow:
        return a
    if a.isdigit() and int(a) > 0:
        return int(a)
    raise CommandError(usage(name))
