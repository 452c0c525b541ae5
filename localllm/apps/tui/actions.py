"""What the user's input does: the app's key bindings and their actions, and a submitted
prompt line (a slash command, or a message; ``//`` sends one that starts with /)."""

from __future__ import annotations

import time
from typing import Callable

from textual.app import App
from textual.binding import Binding

from . import commands as cmds
from .composer import Composer
from .config import DEFAULT_KEYS
from .handlers import Commands
from .replies import Replies
from .state import ChatState
from .view import ConversationLog
from .widgets import code_blocks

# The app's own keys, priority bindings so that they work wherever the focus is (the message
# keys are MessageView's). Their ids are what chat.toml's [keys] remaps.
BINDINGS = [
    Binding(DEFAULT_KEYS["stop"], "stop", "Stop", priority=True, id="chat.stop"),
    Binding(DEFAULT_KEYS["interrupt"], "interrupt", show=False, priority=True,
            id="chat.interrupt"),
    Binding(DEFAULT_KEYS["quit"], "quit", "Quit", priority=True, id="chat.quit"),
    Binding(DEFAULT_KEYS["branch_prev"], "branch(-1)", "Branch", priority=True,
            id="chat.branch_prev"),
    Binding(DEFAULT_KEYS["branch_next"], "branch(1)", show=False, priority=True,
            id="chat.branch_next"),
    Binding(DEFAULT_KEYS["messages_up"], "move_focus(-1)", show=False, priority=True,
            id="chat.messages_up"),
    Binding(DEFAULT_KEYS["messages_down"], "move_focus(1)", show=False, priority=True,
            id="chat.messages_down"),
    Binding(DEFAULT_KEYS["help"], "help", "Help", id="chat.help"),
]

# A second Ctrl+C within this many seconds quits.
INTERRUPT_QUITS_WITHIN = 2.0


class InputActions:
    """The app's response to input: each key action (the app's ``action_*`` methods call
    these) and each submitted prompt line. It keeps when Ctrl+C was last pressed."""

    def __init__(self, app: App, state: ChatState, view: ConversationLog, composer: Composer,
                 replies: Replies, commands: Commands, on_status: Callable[[], None]):
        """Args:
            app: the running app (toasts).
            state: the conversation and its store.
            view: the conversation on screen.
            composer: the prompt box and the draft of the next message.
            replies: the engine side.
            commands: the slash commands.
            on_status: redraws the status bar after a change of state.
        """
        self.app, self.state, self.view, self.composer = app, state, view, composer
        self.replies, self.commands, self.on_status = replies, commands, on_status
        self._last_interrupt = 0.0

    async def submitted(self, text: str) -> None:
        """A prompt line was sent: run the command, or send the message if a reply can
        start (else the text goes back to the box)."""
        if cmds.is_command(text):
            await self.commands.run(text)
            return
        if not self.replies.can_generate():
            self.composer.put_back(text)   # not sent: back in the box
            return
        if text.lstrip().startswith("//"):
            text = text.replace("/", "", 1)
        await self.replies.send(text)

    async def stop(self) -> None:
        """Esc: stop the reply, else leave an edit or a new branch, else go to the box."""
        if self.replies.generating:
            self.replies.stop_reply()
        elif self.composer.leave():
            self.on_status()
        else:
            self.composer.box.focus()

    async def interrupt(self) -> None:
        """Ctrl+C: stop the reply; a second one soon after quits."""
        now = time.monotonic()
        if now - self._last_interrupt < INTERRUPT_QUITS_WITHIN:
            await self.commands.cmd_quit("")
            return
        self._last_interrupt = now
        if self.replies.generating:
            self.replies.stop_reply()
        self.app.notify("Ctrl+C again to quit (or Ctrl+Q).")

    async def branch(self, delta: int) -> None:
        """Switch the focused message's branch, or the last branch point's."""
        if self.replies.generating:
            return
        view = self.view.focused_message()
        if view is not None and view.message is not None:
            await self.commands.branch_step(view.message.id, delta)
            return
        points = self.state.conv.branch_points()
        if points:
            await self.commands.branch_step(points[-1].message.id, delta)

    async def branch_step(self, msg_id: int, delta: int) -> None:
        """A click on a header's arrows: switch that message's branch."""
        if not self.replies.generating and msg_id in self.state.conv.messages:
            await self.commands.branch_step(msg_id, delta)

    def move_focus(self, delta: int) -> None:
        """Move between messages; past the last one, back to the box."""
        if not self.view.move_focus(delta):
            self.composer.box.focus()

    async def help(self) -> None:
        await self.commands.cmd_help("")

    def copy_message(self) -> None:
        view = self.view.focused_message()
        if view is not None:
            self.commands.copy_text(view.text, "the message")

    def copy_code(self) -> None:
        view = self.view.focused_message()
        if view is not None:
            blocks = code_blocks(view.text)
            if blocks:
                self.commands.copy_text("\n".join(blocks), "the code")
            else:
                self.app.notify("This message has no code block.")

    def edit_message(self) -> None:
        view = self.view.focused_message()
        if view is not None and view.message is not None and view.role == "user" \
                and not self.replies.generating:
            self.composer.start_edit(view.message)
            self.on_status()

    async def regen_message(self) -> None:
        view = self.view.focused_message()
        if view is not None and view.message is not None and view.role == "assistant":
            await self.replies.regenerate(self.state.conv.messages[view.message.parent_id])
