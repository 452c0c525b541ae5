"""The `llm chat` app: the conversation on screen, the prompt box and status bar, and the flow
of a turn (store the prompt, stream the reply from the engine thread, store the reply)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll

from .adapter import ChatModel, ContextUsage, EngineThread, ReplyStats
from .config import DEFAULT_KEYS
from .events import (ContextFull, Counted, EngineFailed, Loaded, ReplyChunk, ReplyDone,
                     ReplyRequest, ReplyStarted)
from .handlers import ChatCommands
from .keys import driver_for
from .store import Store, StoreError
from .tree import Conversation, Message
from .widgets import MessageView, NoteView, PromptInput, StatusBar

# A reply needs at least this many tokens of room (or max_tokens, if smaller) to be started.
MIN_REPLY_ROOM = 32


@dataclass
class ChatOptions:
    """Everything the app is started with; the command line builds it."""
    load: Callable[[], object]          # returns a loaded Model; runs on the engine thread
    model_label: str                    # what is being loaded (shown, and kept per conversation)
    database: Path | str
    clipboard: Path
    sampling: dict                      # SamplingParams fields; max_tokens -1: to the context end
    keys: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_KEYS))
    system: str = ""
    resume: int | None = None           # a conversation id


class ChatApp(ChatCommands, App):
    """A terminal chat with branching history, kept in SQLite as it happens."""

    TITLE = "llm chat"
    CSS = """
    #log { height: 1fr; padding: 0 1; scrollbar-size-vertical: 1; }
    MessageView { height: auto; margin: 0 0 1 0; padding: 0 1; }
    MessageView.user { border-left: thick $accent; }
    MessageView.assistant { border-left: thick $success; }
    MessageView:focus { background: $boost; }
    MessageView.dropped { opacity: 60%; }
    MessageView .header { color: $text-muted; }
    MessageView Markdown { margin: 0; padding: 0; }
    MessageView Markdown > *:last-child { margin-bottom: 0; }
    NoteView { color: $text-muted; padding: 0 1; margin: 0 0 1 0; }
    NoteView.error { color: $error; }
    PromptInput { height: auto; max-height: 12; }
    StatusBar { height: 2; background: $panel; padding: 0 1; }
    """
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

    def __init__(self, options: ChatOptions):
        super().__init__()
        self.options = options
        self.store = Store(options.database)
        self.conv: Conversation = (self.store.load(options.resume) if options.resume is not None
                                   else self.new_conversation())
        self.chat_model: ChatModel | None = None
        self.engine = EngineThread(lambda e: self.post_message(EngineFailed(e)))
        self.cancel = threading.Event()
        self.generating = False
        self.editing: Message | None = None     # a user message being rewritten as a branch
        self.new_root = False                   # the next message starts a top-level branch
        self.cause = ""                         # what changed before the next turn (CAUSES)
        self.last_stats: ReplyStats | None = None
        self.usage: ContextUsage | None = None
        self._stream_view: MessageView | None = None
        self.pending_text = ""                  # a message sent back to the box by a full context
        self._load_started = time.perf_counter()
        self._last_interrupt = 0.0
        self.load_error = ""
        self.keys = {**DEFAULT_KEYS, **options.keys}
        self.set_keymap({f"chat.{k}": v for k, v in self.keys.items()})

    def get_driver_class(self):
        return driver_for(super().get_driver_class())

    def new_conversation(self) -> Conversation:
        """An unsaved conversation with the starting system prompt and settings (stored with
        its first message)."""
        return Conversation(id=0, model=self.options.model_label, system=self.options.system,
                            settings=dict(self.options.sampling))

    # ---- layout and start -----------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield VerticalScroll(id="log")
        yield PromptInput(self.store.recent_prompts(), self.keys["send"], self.keys["newline"],
                          id="prompt",
                          placeholder="Message (Enter sends, Ctrl+J new line, /help)")
        yield StatusBar(id="status", markup=False)

    @property
    def log_view(self) -> VerticalScroll:
        return self.query_one("#log", VerticalScroll)

    @property
    def prompt_box(self) -> PromptInput:
        return self.query_one("#prompt", PromptInput)

    async def on_mount(self) -> None:
        self.prompt_box.focus()
        await self.show_conversation()
        await self.note(f"Loading {self.options.model_label}…", key="loading")
        self._status_timer = self.set_interval(0.25, self.update_status)
        self.engine.submit(self._load_job)

    def _load_job(self) -> None:
        self.post_message(Loaded(ChatModel(self.options.load())))

    async def on_loaded(self, event: Loaded) -> None:
        self.chat_model = event.chat_model
        info = event.chat_model.info
        await self.remove_note("loading")
        await self.note(f"{info.name} {info.quant} loaded in {info.load_seconds:.1f} s "
                        f"(context {info.ctx} tokens). /help lists commands and keys.")
        self.recount()
        head = self.conv.head()
        if head is not None and head.role == "user":
            await self.note("The last message has no reply (the app stopped while writing it): "
                            "/regen answers it.")

    def on_unmount(self) -> None:
        self._status_timer.stop()
        self.cancel.set()
        self.engine.stop()

    # ---- the conversation on screen -------------------------------------------------

    def message_views(self) -> list[MessageView]:
        return [w for w in self.log_view.children if isinstance(w, MessageView)]

    async def show_conversation(self, path: list[Message] | None = None) -> None:
        """Make the views match ``path`` (default: the current path), keeping the views of
        the shared start and rebuilding the rest."""
        path = self.conv.path() if path is None else path
        views = self.message_views()
        keep = 0
        while (keep < min(len(views), len(path)) and views[keep].message is not None
               and views[keep].message.id == path[keep].id):
            keep += 1
        children = list(self.log_view.children)
        cut = children.index(views[keep - 1]) + 1 if keep else 0
        if children[cut:]:
            await self.log_view.remove_children(children[cut:])
        new = [MessageView(m.role, m) for m in path[keep:]]
        if new:
            await self.log_view.mount_all(new)
        for v in self.message_views():
            self.refresh_header(v)
        self.log_view.scroll_end(animate=False)

    def refresh_header(self, view: MessageView) -> None:
        if view.message is None:   # not stored yet: a reply being written, or its prompt
            view.set_header(writing=view.role == "assistant")
            return
        sibs = self.conv.siblings(view.message.id)
        view.set_header(sibs.index(view.message.id) + 1, len(sibs))

    async def note(self, text: str, error: bool = False, key: str = "") -> NoteView:
        """Show a notice at the end of the conversation."""
        view = NoteView(text, error=error)
        if key:
            view.add_class(f"note-{key}")
        await self.log_view.mount(view)
        self.log_view.scroll_end(animate=False)
        return view

    async def remove_note(self, key: str) -> None:
        await self.log_view.query(f".note-{key}").remove()

    def update_status(self) -> None:
        info = self.chat_model.info if self.chat_model else None
        if self.load_error:
            state = f"the model did not load: {self.load_error}"
        elif info is None:
            state = (f"loading {self.options.model_label}… "
                     f"{time.perf_counter() - self._load_started:.0f} s (a first run compiles "
                     "the kernels: about a minute)")
        elif self.generating:
            state = "writing… (Esc stops)"
        elif self.editing is not None:
            n = sum(1 for m in self.conv.path()[:self.conv.path().index(self.editing) + 1]
                    if m.role == "user") if self.editing in self.conv.path() else "?"
            state = f"editing message {n}: Enter sends it as a new branch, Esc cancels"
        elif self.new_root:
            state = "the next message starts a new branch from the summary (Esc cancels)"
        else:
            state = ""
        bars = self.query("#status")  # empty while the app is closing
        if bars:
            bars.first(StatusBar).show(info, self.usage, self.last_stats, state)

    def recount(self) -> None:
        """Count the tokens of the current path on the engine thread (for the meter)."""
        if self.chat_model is None:
            return
        cm, messages = self.chat_model, self.conv.prompt()
        self.engine.submit(lambda: self.post_message(Counted(cm.context(cm.count(messages)))))

    def on_counted(self, event: Counted) -> None:
        self.usage = event.usage
        self.update_status()

    # ---- a turn -----------------------------------------------------------------------

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        text = event.text
        if self.is_command(text):
            await self.run_command(text)
            return
        if not self.can_generate():
            if not self.prompt_box.text:
                self.prompt_box.set_text(text)   # not sent: back in the box
            return
        if text.lstrip().startswith("//"):
            text = text.replace("/", "", 1)
        await self.send(text)

    def can_generate(self) -> bool:
        if self.load_error:
            self.notify(f"The model did not load: {self.load_error}", severity="error")
            return False
        if self.chat_model is None:
            self.notify("The model is still loading.", severity="warning")
            return False
        if self.generating:
            self.notify("A reply is being written: Esc stops it.", severity="warning")
            return False
        return True

    async def send(self, text: str) -> None:
        """Send a user message: after the head, or as a sibling of the message being
        edited (or of an unanswered one), or as a new top-level branch."""
        head = self.conv.head()
        cause = self.cause
        if self.new_root:
            parent_id, cause = None, "summary"
        elif self.editing is not None:
            parent_id, cause = self.editing.parent_id, "edit"
        elif head is not None and head.role == "user":
            parent_id = head.parent_id
        else:
            parent_id = head.id if head else None
        path = self.path_to(parent_id)
        await self.show_conversation(path)
        view = MessageView("user", text=text)
        await self.log_view.mount(view)
        self.refresh_header(view)
        messages = self.conv.prompt(path) + [{"role": "user", "content": text}]
        self.start_reply(ReplyRequest(messages, self.sampling(), cause, text, parent_id))

    def path_to(self, msg_id: int | None) -> list[Message]:
        """The path from the top to ``msg_id`` (empty for None)."""
        out = []
        while msg_id is not None:
            m = self.conv.messages[msg_id]
            out.append(m)
            msg_id = m.parent_id
        return out[::-1]

    def sampling(self) -> dict:
        """The conversation's sampling settings over the starting ones (a loaded file may
        name only some)."""
        return {**self.options.sampling, **self.conv.settings}

    def start_reply(self, req: ReplyRequest) -> None:
        self.generating, self.cause = True, ""
        self.cancel.clear()
        self.update_status()
        self.engine.submit(lambda: self._reply_job(req))

    def _reply_job(self, req: ReplyRequest) -> None:
        """On the engine thread: check the room, store the prompt, stream the reply."""
        cm = self.chat_model
        needed = cm.count(req.messages)
        max_tokens = req.sampling.get("max_tokens", -1)
        room = MIN_REPLY_ROOM if max_tokens < 0 else min(max_tokens, MIN_REPLY_ROOM)
        if needed + max(room, 1) > cm.info.ctx:
            self.post_message(ContextFull(req, needed, self._drop_hint(req.messages)))
            return
        parent_id = req.parent_id
        if req.user_text is not None:
            parent_id = self.call_from_thread(self._store_user, req).id
        self.post_message(ReplyStarted(parent_id, cm.context(needed)))
        reply = cm.reply(req.messages, req.sampling, self.cancel,
                         lambda text, n, usage: self.post_message(ReplyChunk(text, n, usage)),
                         req.cause)
        self.post_message(ReplyDone(parent_id, reply))

    def _drop_hint(self, messages: list[dict]) -> int | None:
        """On the engine thread: the fewest oldest turns to leave out for the prompt to fit."""
        cm = self.chat_model
        system = messages[:1] if messages and messages[0]["role"] == "system" else []
        turns = messages[len(system):]
        for k in range(1, len(turns) // 2 + 1):
            rest = system + turns[2 * k:]
            if cm.count(rest) + MIN_REPLY_ROOM <= cm.info.ctx:
                return k
        return None

    def _store_user(self, req: ReplyRequest) -> Message:
        msg = self.store.add_message(self.conv, req.parent_id, "user", req.user_text)
        view = self.message_views()[-1]
        view.message = msg
        self.refresh_header(view)
        self.editing, self.new_root = None, False
        return msg

    async def on_reply_started(self, event: ReplyStarted) -> None:
        await self.show_conversation(self.path_to(event.parent_id))
        view = MessageView("assistant")
        await self.log_view.mount(view)
        self.refresh_header(view)
        await view.start_stream()
        self._stream_view = view
        self.usage = event.usage

    async def on_reply_chunk(self, event: ReplyChunk) -> None:
        log = self.log_view
        # Follow the reply unless the user has scrolled up to read (a piece adds a line or two).
        following = log.scroll_y >= log.max_scroll_y - 3
        if self._stream_view is not None:
            await self._stream_view.write(event.text)
        if following:
            log.scroll_end(animate=False)
        self.usage = event.usage

    async def on_reply_done(self, event: ReplyDone) -> None:
        view, self._stream_view = self._stream_view, None
        self.generating = False
        reply = event.reply
        if view is not None:
            await view.end_stream()
        if reply.text or reply.stats.finish_reason != "cancelled":
            try:
                msg = self.store.add_message(self.conv, event.parent_id, "assistant",
                                             reply.text, reply.stats.as_meta())
            except StoreError as e:  # e.g. a full disk: the reply stays on screen only
                await self.note(f"{e}: this reply is shown but not stored.", error=True)
            else:
                if view is not None:
                    view.message = msg
                    self.refresh_header(view)
        elif view is not None:
            await view.remove()
            await self.note("Stopped before any text was written; /regen tries again.")
        self.last_stats = reply.stats
        self.usage = reply.usage
        if reply.stats.finish_reason == "context":
            await self.note(self.context_full_text(), error=True)
        self.update_status()

    async def on_context_full(self, event: ContextFull) -> None:
        self.generating = False
        req = event.request
        await self.show_conversation(self.path_to(req.parent_id))
        if req.user_text is not None:
            self.prompt_box.set_text(req.user_text)
            self.pending_text = req.user_text
        limit = self.chat_model.info.ctx
        await self.note(f"The context is full: this turn needs {event.needed} tokens plus room "
                        f"for the reply, and the context holds {limit}. "
                        + self.context_full_text(event.drop_hint)
                        + (" Your message is back in the box." if req.user_text else ""),
                        error=True)
        self.update_status()

    def context_full_text(self, drop_hint: int | None = None) -> str:
        drop = f"/drop {drop_hint}" if drop_hint else "/drop N"
        return (f"Choose: /clear starts a new conversation; {drop} leaves the oldest turns out "
                "of the context (they stay on screen and saved); /summary starts a new branch "
                "from a summary. Nothing is cut without asking.")

    async def on_engine_failed(self, event: EngineFailed) -> None:
        self.generating = False
        if self._stream_view is not None:
            await self._stream_view.end_stream()
            self._stream_view = None
        err = event.error
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if self.chat_model is None:
            self.load_error = msg
            await self.remove_note("loading")
            await self.note(f"error: cannot load {self.options.model_label}: {msg}", error=True)
        else:
            await self.note(f"error: {msg}", error=True)
        self.update_status()
