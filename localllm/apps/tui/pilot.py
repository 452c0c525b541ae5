"""Driving the chat app from a script through textual's Pilot (``App.run_test``): the
screenshot script and the tests type into it and wait for it the same way."""

from __future__ import annotations

import time
from typing import Callable


async def until(pilot, cond: Callable[[], object], timeout: float = 300.0) -> None:
    """Let the app run until ``cond()`` holds.

    Raises:
        TimeoutError: it did not within ``timeout`` seconds.
    """
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("the app did not get there in time")
        await pilot.pause(0.05)


async def say(pilot, text: str, timeout: float = 300.0) -> None:
    """Type a message or command into the prompt box, press Enter, and wait until any reply
    it started is written."""
    app = pilot.app
    app.prompt_box.focus()
    app.prompt_box.set_text(text)
    await pilot.press("enter")
    await pilot.pause()
    await until(pilot, lambda: not app.generating, timeout)
