"""The `llm chat` app: the textual App that lays out the conversation, the prompt box and the
status bar, and wires the parts that do the work (state, composer, view, replies, input)."""

from __future__ import annotations

from textual.app import App, ComposeResult

from . import actions
from .actions import InputActions
from .adapter import ChatModel
from .composer import Composer
from .config import DEFAULT_KEYS
from .events import (ContextFull, Counted, EngineFailed, Loaded, ReplyChunk, ReplyDone,
                     ReplyStarted, ReplyThinking, SummaryDone)
from .handlers import Commands
from .keys import driver_for
from .replies import Replies
from .state import ChatOptions, ChatState
from .tree import Conversation
from .view import ConversationLog
from .widgets import PromptInput, StatusBar

__all__ = ["ChatApp", "ChatOptions"]


class ChatApp(App):
    """A terminal chat with branching history, kept in SQLite as it happens.

    It owns the widgets and the parts, and routes textual's events and actions to them:
    ChatState (the conversation and its store), Composer (the prompt box and the draft of
    the next message), ConversationLog (the conversation on screen), Replies (the engine
    side), Commands (the slash commands) and InputActions (keys and submitted lines).
    """

    TITLE = "llm chat"
    CSS = """
    #log { height: 1fr; padding: 0 1; scrollbar-size-vertical: 1; }
    MessageView { height: auto; margin: 0 0 1 0; padding: 0 1; }
    MessageView.user { border-left: thick $accent; }
    MessageView.assistant { border-left: thick $success; }
    MessageView:focus { background: $boost; }
    MessageView.dropped { opacity: 60%; }
    MessageView .header { color: $text-muted; }
    MessageView .thinking { color: $text-muted; text-style: italic; }
    MessageView Markdown { margin: 0; padding: 0; }
    MessageView Markdown > *:last-child { margin-bottom: 0; }
    NoteView { color: $text-muted; padding: 0 1; margin: 0 0 1 0; }
    NoteView.error { color: $error; }
    PromptInput { height: auto; max-height: 12; }
    StatusBar { height: 2; background: $panel; padding: 0 1; }
    """
    BINDINGS = actions.BINDINGS

    def __init__(self, options: ChatOptions):
        super().__init__()
        self.options = options
        self.keys = {**DEFAULT_KEYS, **options.keys}
        self.state = ChatState(options)
        self.chat_view = ConversationLog(id="log")
        self.composer = Composer(PromptInput(
            self.state.store.recent_prompts(), self.keys["send"], self.keys["newline"],
            id="prompt", placeholder="Message (Enter sends, Ctrl+J new line, /help)"))
        self.replies = Replies(self, self.state, self.chat_view, self.composer,
                               self.update_status)
        self.commands = Commands(self, self.state, self.chat_view, self.composer, self.replies,
                                 self.keys, self.update_status)
        self.input = InputActions(self, self.state, self.chat_view, self.composer,
                                  self.replies, self.commands, self.update_status)
        self.set_keymap({f"chat.{k}": v for k, v in self.keys.items()})

    def get_driver_class(self):
        return driver_for(super().get_driver_class())

    # ---- what scripts and the command line read ---------------------------------------

    @property
    def conv(self) -> Conversation:
        """The conversation on screen."""
        return self.state.conv

    @property
    def chat_model(self) -> ChatModel | None:
        """The loaded model; None while it loads (or if it did not)."""
        return self.replies.chat_model

    @property
    def generating(self) -> bool:
        """Whether a reply (or a summary) is being written."""
        return self.replies.generating

    @property
    def prompt_box(self) -> PromptInput:
        return self.composer.box

    # ---- layout and start -----------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield self.chat_view
        yield self.composer.box
        yield StatusBar(id="status", markup=False)

    async def on_mount(self) -> None:
        self.prompt_box.focus()
        await self.chat_view.show(self.state.conv)
        await self.chat_view.note(f"Loading {self.options.model_label}…", key="loading")
        self._status_timer = self.set_interval(0.25, self.update_status)
        self.replies.start_loading(self.options.load)

    def on_unmount(self) -> None:
        self._status_timer.stop()
        self.replies.close()

    def update_status(self) -> None:
        """Redraw the status bar from the engine's figures and the draft's state."""
        state = (self.replies.activity(self.options.model_label)
                 or self.composer.draft.activity(self.state.conv.path()))
        bars = self.query("#status")  # empty while the app is closing
        if bars:
            bars.first(StatusBar).show(self.replies.info, self.replies.usage,
                                       self.replies.last_stats, state)

    # ---- events: from the prompt box and the engine thread ----------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        await self.input.submitted(event.text)

    async def on_loaded(self, event: Loaded) -> None:
        await self.replies.on_loaded(event)

    def on_counted(self, event: Counted) -> None:
        self.replies.on_counted(event)

    async def on_reply_started(self, event: ReplyStarted) -> None:
        await self.replies.on_reply_started(event)

    async def on_reply_chunk(self, event: ReplyChunk) -> None:
        await self.replies.on_reply_chunk(event)

    def on_reply_thinking(self, event: ReplyThinking) -> None:
        self.replies.on_reply_thinking(event)

    async def on_reply_done(self, event: ReplyDone) -> None:
        await self.replies.on_reply_done(event)

    async def on_context_full(self, event: ContextFull) -> None:
        await self.replies.on_context_full(event)

    async def on_engine_failed(self, event: EngineFailed) -> None:
        await self.replies.on_engine_failed(event)

    async def on_summary_done(self, event: SummaryDone) -> None:
        await self.replies.on_summary_done(event)

    # ---- actions: the keys (BINDINGS, MessageView's) and the headers' arrows ----------

    async def action_stop(self) -> None:
        await self.input.stop()

    async def action_interrupt(self) -> None:
        await self.input.interrupt()

    def action_toggle_thinking(self) -> None:
        """Show or fold the thinking of the focused reply."""
        view = self.chat_view.focused_message()
        if view is not None:
            view.toggle_thinking()

    async def action_branch(self, delta: int) -> None:
        await self.input.branch(delta)

    async def action_branch_step(self, msg_id: int, delta: int) -> None:
        await self.input.branch_step(msg_id, delta)

    def action_move_focus(self, delta: int) -> None:
        self.input.move_focus(delta)

    async def action_help(self) -> None:
        await self.input.help()

    def action_copy_message(self) -> None:
        self.input.copy_message()

    def action_copy_code(self) -> None:
        self.input.copy_code()

    def action_edit_message(self) -> None:
        self.input.edit_message()

    async def action_regen_message(self) -> None:
        await self.input.regen_message()
