"""The chat's widgets: the prompt box, a message (Markdown for replies), notes, the status bar."""

from __future__ import annotations

from markdown_it import MarkdownIt
from textual import events
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message as TextualMessage
from textual.widgets import Markdown, Static, TextArea

from .adapter import ContextUsage, ModelInfo, ReplyStats
from .config import DEFAULT_KEYS
from .tree import Message


def code_blocks(markdown: str) -> list[str]:
    """The fenced and indented code blocks of a Markdown text, in order."""
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [t.content for t in tokens if t.type in ("fence", "code_block")]


class PromptInput(TextArea):
    """Multi-line input: the send keys send, the newline keys break the line, Up in an empty
    box (or while going through history) recalls earlier prompts.

    Send and newline are handled here, in key order, not as priority bindings: those run
    ahead of the characters still queued for the box, and a fast paste or burst of keys
    would be sent cut short.
    """

    class Submitted(TextualMessage):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, prompts: list[str], send_keys: str, newline_keys: str, **kwargs):
        super().__init__(soft_wrap=True, show_line_numbers=False, highlight_cursor_line=False,
                         **kwargs)
        self.prompts = prompts
        self.send_keys = set(send_keys.split(","))
        self.newline_keys = set(newline_keys.split(","))
        self._recall: int | None = None   # index into prompts while recalling
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        keys = set(event.aliases)
        if keys & self.send_keys:
            event.stop()
            event.prevent_default()
            self.action_submit()
        elif keys & self.newline_keys:
            event.stop()
            event.prevent_default()
            self.insert("\n")
        else:
            await super()._on_key(event)

    def action_submit(self) -> None:
        text = self.text
        if not text.strip():
            return
        # Cleared now, not when the app handles the message: keys typed meanwhile stay.
        self.remember(text)
        self.set_text("")
        self.post_message(self.Submitted(text))

    def set_text(self, text: str) -> None:
        """Replace the text and put the cursor at its end."""
        self.load_text(text)
        self.move_cursor(self.document.end)
        self._recall = None

    def remember(self, text: str) -> None:
        if text.strip() and (not self.prompts or self.prompts[-1] != text):
            self.prompts.append(text)
        self._recall = None

    def action_cursor_up(self, select: bool = False) -> None:
        recalling = self._recall is not None and self.cursor_location[0] == 0
        if not select and self.prompts and (not self.text or recalling):
            if self._recall is None:
                self._draft, self._recall = self.text, len(self.prompts)
            if self._recall > 0:
                self._recall -= 1
                self.load_text(self.prompts[self._recall])
                self.move_cursor(self.document.end)
            return
        super().action_cursor_up(select)

    def action_cursor_down(self, select: bool = False) -> None:
        last_row = self.cursor_location[0] == self.document.line_count - 1
        if not select and self._recall is not None and last_row:
            self._recall += 1
            if self._recall >= len(self.prompts):
                text, self._recall = self._draft, None
            else:
                text = self.prompts[self._recall]
            self.load_text(text)
            self.move_cursor(self.document.end)
            return
        super().action_cursor_down(select)


class MessageView(Vertical, can_focus=True):
    """One message: a header (role, branch position, reply figures) and its text."""

    BINDINGS = [
        Binding(DEFAULT_KEYS["copy_message"], "app.copy_message", "Copy", id="chat.copy_message"),
        Binding(DEFAULT_KEYS["copy_code"], "app.copy_code", "Copy code", id="chat.copy_code"),
        Binding(DEFAULT_KEYS["edit"], "app.edit_message", "Edit", id="chat.edit"),
        Binding(DEFAULT_KEYS["regen"], "app.regen_message", "Regenerate", id="chat.regen"),
        Binding(DEFAULT_KEYS["thinking"], "app.toggle_thinking", "Thinking", id="chat.thinking"),
    ]

    def __init__(self, role: str, message: Message | None = None, text: str = ""):
        """Args:
            role: user or assistant.
            message: the stored message; None while it is being written.
            text: the text to show when there is no stored message yet.
        """
        super().__init__(classes=role)
        self.role = role
        self.message = message
        self.header = Static("", classes="header", markup=True)
        self.body: Markdown | Static = (Markdown("", classes="body") if role == "assistant"
                                        else Static("", classes="body", markup=False))
        self._stream = None
        self._text = message.content if message else text
        # a reasoning model's thinking: one summary line, the text itself when opened
        meta = message.meta if message else {}
        self.reasoning = str(meta.get("reasoning", ""))
        self.reasoning_tokens = int(meta.get("reasoning_tokens", 0) or 0)
        self.thinking_open = False
        self._thinking_done = message is not None
        self.thinking = Static("", classes="thinking", markup=False)

    def compose(self):
        yield self.header
        yield self.thinking
        yield self.body

    async def on_mount(self) -> None:
        self._show_thinking()
        await self._show_text(self._text)

    def _show_thinking(self) -> None:
        self.thinking.display = bool(self.reasoning)
        if not self.reasoning:
            return
        mark = "▾" if self.thinking_open else "▸"
        line = (f"{mark} Thought for {self.reasoning_tokens} tokens" if self._thinking_done
                else f"{mark} Thinking…")
        self.thinking.update(f"{line}\n{self.reasoning}" if self.thinking_open else line)

    def think(self, text: str, tokens: int) -> None:
        """Add a piece of the thinking being streamed."""
        self.reasoning += text
        self.reasoning_tokens = tokens
        self._show_thinking()

    def thought(self, tokens: int) -> None:
        """The thinking has ended (the reply is done): the summary says how long it was."""
        self.reasoning_tokens, self._thinking_done = tokens, True
        self._show_thinking()

    def toggle_thinking(self) -> None:
        """Show or fold the thinking."""
        self.thinking_open = not self.thinking_open
        self._show_thinking()

    async def _show_text(self, text: str) -> None:
        if isinstance(self.body, Markdown):
            await self.body.update(text)
        else:
            self.body.update(text)

    @property
    def text(self) -> str:
        return self._text

    def set_header(self, position: int = 1, count: int = 1, writing: bool = False) -> None:
        """Redraw the header line; ``position``/``count`` place the message among siblings."""
        label = "You" if self.role == "user" else "Assistant"
        parts = [f"[b]{label}[/b]"]
        if count > 1 and self.message is not None:
            mid = self.message.id
            parts.append(f'[@click="app.branch_step({mid},-1)"]◀[/] {position}/{count} '
                         f'[@click="app.branch_step({mid},1)"]▶[/]')
        meta = self.message.meta if self.message else {}
        if writing:
            parts.append("[i]writing…[/i]")
        elif self.role == "assistant" and meta:
            parts.append(reply_figures(meta))
        if meta.get("dropped"):
            parts.append("[i](left out of the context)[/i]")
        self.header.update("  ".join(parts))
        self.set_class(bool(meta.get("dropped")), "dropped")

    async def start_stream(self) -> None:
        self._stream = Markdown.get_stream(self.body)

    async def write(self, text: str) -> None:
        self._text += text
        if self._stream is not None:
            await self._stream.write(text)

    async def end_stream(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None


def reply_figures(meta: dict) -> str:
    """A reply's header figures: tokens, speed, and why it ended when not at end of text."""
    n = meta.get("generated_tokens", 0)
    out = f"[dim]{n} tok · {meta.get('generate_tps', 0.0):.1f} tok/s[/dim]"
    why = {"cancelled": "stopped", "length": "max tokens reached",
           "context": "cut: the context is full"}.get(meta.get("finish_reason", ""))
    return out + (f"  [i]({why})[/i]" if why else "")


def speculation_figures(stats: ReplyStats) -> str:
    """Drafts accepted, tokens per model pass and the speedup, for the status bar."""
    speed = f" · {stats.speedup:.2f}x" if stats.speedup else ""
    return (f"drafts {100 * stats.accepted_tokens / stats.draft_tokens:.0f}% accepted · "
            f"{stats.tokens_per_pass:.2f} tok/pass{speed}")


class NoteView(Static):
    """A notice in the conversation (help, statistics, errors); not part of it."""

    def __init__(self, text: str, markup: bool = False, error: bool = False):
        super().__init__(text, markup=markup, classes="note error" if error else "note")


class StatusBar(Static):
    """Two lines: the model and its context, then the last reply's reuse and speed."""

    def show(self, info: ModelInfo | None, usage: ContextUsage | None,
             stats: ReplyStats | None, state: str) -> None:
        """Redraw from the latest figures; ``state`` is the app's activity (loading, writing)."""
        mib = 1 << 20
        if info is None:
            line1 = state or "no model"
        else:
            line1 = f"{info.name} {info.quant} · {info.placement}"
            if usage is not None:
                line1 += (f" │ ctx {usage.used}/{usage.limit} · KV {usage.kv_bytes / mib:.1f}/"
                          f"{usage.kv_limit_bytes / mib:.0f} MiB {usage.kv_type}")
        line2 = state if info is not None and state else ""
        if stats is not None:
            figures = (f"reused {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens │ "
                       f"prompt {stats.prompt_tps:.0f} tok/s · gen {stats.generate_tps:.1f} tok/s")
            if stats.draft_tokens:
                figures += f" │ {speculation_figures(stats)}"
            if stats.reuse_note:
                figures += f" │ recomputed: {stats.reuse_note}"
            line2 = f"{line2} │ {figures}" if line2 else figures
        self.update(f"{line1}\n{line2}")
