"""Alt+Enter in terminals without the Kitty keyboard protocol. They send ESC CR, which
textual's parser reports as Enter (its issue 6663), or as ^ and Enter when more input
follows at once (a paste, tmux send-keys); the driver here rewrites ESC CR, before parsing,
as the Kitty protocol's own Alt+Enter sequence, which the parser reads right."""

from __future__ import annotations

import os
import selectors
from codecs import getincrementaldecoder

from textual.driver import Driver

ALT_ENTER = "\x1b[13;3u"   # Kitty keyboard protocol: key 13 (Enter), modifiers 1 + Alt


def rewrite_alt_enter(data: str) -> str:
    """Legacy Alt+Enter (ESC CR; ESC LF from some terminals) as the Kitty sequence."""
    return data.replace("\x1b\r", ALT_ENTER).replace("\x1b\n", ALT_ENTER)


def driver_for(base: type[Driver]) -> type[Driver]:
    """The driver to run the chat with: on POSIX terminals, textual's own reading input
    through ``rewrite_alt_enter``; anything else (Windows, a driver chosen through
    textual's settings) unchanged."""
    from textual._xterm_parser import XTermParser
    from textual.drivers.linux_driver import LinuxDriver
    if base is not LinuxDriver:
        return base

    class ChatDriver(LinuxDriver):
        def run_input_thread(self) -> None:
            parser = XTermParser(self._debug)
            decode = getincrementaldecoder("utf-8")().decode
            # select(), not epoll/kqueue: kqueue cannot watch a tty on macOS.
            with selectors.SelectSelector() as selector:
                selector.register(self.fileno, selectors.EVENT_READ)
                while not self.exit_event.is_set():
                    for _ in selector.select(0.1):
                        data = decode(os.read(self.fileno, 4096))
                        if not data:
                            break
                        for event in parser.feed(rewrite_alt_enter(data)):
                            self.process_message(event)
                    for event in parser.tick():
                        self.process_message(event)

    return ChatDriver
