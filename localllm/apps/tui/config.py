"""Where the chat keeps its files, and its key bindings: defaults that a ``[keys]`` table in
``chat.toml`` (in the user's config directory) can change."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# action -> keys (textual's names, comma separated). Ctrl+J and Alt+Enter give a new line in
# every terminal; Shift+Enter only where the terminal reports it (the Kitty keyboard protocol).
DEFAULT_KEYS: dict[str, str] = {
    "send": "enter",
    "newline": "shift+enter,ctrl+j,alt+enter",
    "stop": "escape",
    "interrupt": "ctrl+c",
    "quit": "ctrl+q",
    "branch_prev": "alt+left",
    "branch_next": "alt+right",
    "messages_up": "alt+up",
    "messages_down": "alt+down",
    "copy_message": "c",
    "copy_code": "y",
    "edit": "e",
    "regen": "r",
    "thinking": "t",
    "help": "f1",
}

KEY_HELP: dict[str, str] = {
    "send": "send the message",
    "newline": "new line in the message",
    "stop": "stop the reply (or leave a message / cancel an edit)",
    "interrupt": "stop the reply; twice quits",
    "quit": "quit",
    "branch_prev": "previous branch of the message (or of the last branch point)",
    "branch_next": "next branch of the message (or of the last branch point)",
    "messages_up": "move to the previous message",
    "messages_down": "move to the next message",
    "copy_message": "copy the message (on a message)",
    "copy_code": "copy the message's code blocks (on a message)",
    "edit": "edit the message: sending makes a branch (on a user message)",
    "regen": "regenerate the reply as a new branch (on a reply)",
    "thinking": "show or fold a reply's thinking (on a reply of a reasoning model)",
    "help": "help",
}


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the problem."""


@dataclass
class ChatPaths:
    """The chat's database and config file."""
    database: Path
    config: Path
    clipboard: Path     # copies are written here too, for terminals without OSC 52


def default_paths() -> ChatPaths:
    """The user's data and config directories (XDG on Linux, the platform's elsewhere)."""
    from platformdirs import user_config_path, user_data_path
    data = user_data_path("localllm", appauthor=False)
    return ChatPaths(database=data / "chat.db",
                     config=user_config_path("localllm", appauthor=False) / "chat.toml",
                     clipboard=data / "clipboard.txt")


@dataclass
class ChatConfig:
    """Settings read from chat.toml."""
    keys: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_KEYS))


def load_config(path: Path) -> ChatConfig:
    """Read chat.toml; a missing file gives the defaults.

    Raises:
        ConfigError: bad TOML, an unknown action or a value that is not a key string.
    """
    cfg = ChatConfig()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return cfg
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    unknown = set(data) - {"keys"}
    if unknown:
        raise ConfigError(f"{path}: unknown section {sorted(unknown)[0]!r} (known: keys)")
    keys = data.get("keys", {})
    if not isinstance(keys, dict):
        raise ConfigError(f"{path}: [keys] must be a table of action = \"key,key\"")
    for action, value in keys.items():
        if action not in DEFAULT_KEYS:
            raise ConfigError(f"{path}: unknown action {action!r} in [keys] "
                              f"(known: {', '.join(DEFAULT_KEYS)})")
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{path}: [keys] {action} must be a non-empty string such as "
                              f"\"{DEFAULT_KEYS[action]}\"")
        cfg.keys[action] = ",".join(k.strip() for k in value.split(",") if k.strip())
    return cfg
