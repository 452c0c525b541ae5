"""The conversation on screen: a view per message of the branch shown, notes between them,
the reply being streamed, scrolling, and which message has the focus."""

from __future__ import annotations

from textual.containers import VerticalScroll

from .tree import Conversation, Message
from .widgets import MessageView, NoteView


def shared_start(shown: list[Message | None], path: list[Message]) -> int:
    """How many views at the top already show the start of ``path``.

    Args:
        shown: the stored message of each view on screen (None while one is written).
        path: the messages to show, oldest first.
    Returns:
        The number of views that can stay.
    """
    keep = 0
    while (keep < min(len(shown), len(path)) and shown[keep] is not None
           and shown[keep].id == path[keep].id):
        keep += 1
    return keep


class ConversationLog(VerticalScroll):
    """The scrolling log of the conversation. It owns the message views and notes, and the
    view of the reply being streamed; the Conversation it shows is passed in, never kept."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._stream: MessageView | None = None

    def message_views(self) -> list[MessageView]:
        """The views of messages, top to bottom (without the notes)."""
        return [w for w in self.children if isinstance(w, MessageView)]

    async def show(self, conv: Conversation, path: list[Message] | None = None) -> None:
        """Make the views match a path, keeping the views of the shared start and
        rebuilding the rest.

        Args:
            conv: the conversation on screen.
            path: the messages to show; None: the conversation's current path.
        """
        path = conv.path() if path is None else path
        views = self.message_views()
        keep = shared_start([v.message for v in views], path)
        children = list(self.children)
        cut = children.index(views[keep - 1]) + 1 if keep else 0
        if children[cut:]:
            await self.remove_children(children[cut:])
        new = [MessageView(m.role, m) for m in path[keep:]]
        if new:
            await self.mount_all(new)
        for v in self.message_views():
            self.refresh_header(conv, v)
        self.scroll_end(animate=False)

    def refresh_header(self, conv: Conversation, view: MessageView) -> None:
        """Redraw a view's header: its place among its siblings, or that it is not stored."""
        if view.message is None:   # not stored yet: a reply being written, or its prompt
            view.set_header(writing=view.role == "assistant")
            return
        sibs = conv.siblings(view.message.id)
        view.set_header(sibs.index(view.message.id) + 1, len(sibs))

    async def note(self, text: str, error: bool = False, key: str = "") -> NoteView:
        """Show a notice at the end of the conversation.

        Args:
            text: the notice, shown as it is (no markup).
            error: shown as an error.
            key: a name to remove it by (``remove_note``).
        Returns:
            The note's widget.
        """
        view = NoteView(text, error=error)
        if key:
            view.add_class(f"note-{key}")
        await self.mount(view)
        self.scroll_end(animate=False)
        return view

    async def remove_note(self, key: str) -> None:
        """Remove the notes shown with ``key``."""
        await self.query(f".note-{key}").remove()

    async def add_prompt(self, conv: Conversation, text: str) -> None:
        """Show a user message that is sent but not stored yet."""
        view = MessageView("user", text=text)
        await self.mount(view)
        self.refresh_header(conv, view)

    def prompt_stored(self, conv: Conversation, msg: Message) -> None:
        """The last view's message is stored: it gets its id and its header."""
        view = self.message_views()[-1]
        view.message = msg
        self.refresh_header(conv, view)

    async def start_reply(self, conv: Conversation) -> None:
        """Add the view of a reply about to be streamed."""
        view = MessageView("assistant")
        await self.mount(view)
        self.refresh_header(conv, view)
        await view.start_stream()
        self._stream = view

    async def write(self, text: str) -> None:
        """Add a piece of the streamed reply."""
        # Follow the reply unless the user has scrolled up to read (a piece adds a line or two).
        following = self.scroll_y >= self.max_scroll_y - 3
        if self._stream is not None:
            await self._stream.write(text)
        if following:
            self.scroll_end(animate=False)

    def think(self, text: str, tokens: int) -> None:
        """Add a piece of the streamed reply's thinking (shown collapsed unless opened)."""
        if self._stream is not None:
            self._stream.think(text, tokens)

    def take_reply(self) -> MessageView | None:
        """The view of the streamed reply, which stops being streamed into (its caller
        ends its stream); None if there is none."""
        view, self._stream = self._stream, None
        return view

    def focused_message(self) -> MessageView | None:
        """The message view that has the focus, if one has it."""
        focused = self.app.focused
        return focused if isinstance(focused, MessageView) else None

    def focus_message(self, msg_id: int) -> None:
        """Give the focus to the view of a message, if it is on screen."""
        for v in self.message_views():
            if v.message is not None and v.message.id == msg_id:
                v.focus()

    def scroll_to_message(self, msg_id: int) -> None:
        """Scroll the view of a message into sight, if it is on screen."""
        for v in self.message_views():
            if v.message is not None and v.message.id == msg_id:
                v.scroll_visible(animate=False)

    def move_focus(self, delta: int) -> bool:
        """Move the focus ``delta`` messages up (negative) or down from the focused one, or
        onto the last message from outside the log.

        Returns:
            False when that goes past the last message, for the prompt box to take the
            focus; True otherwise (with no message, nothing moves).
        """
        views = self.message_views()
        if not views:
            return True
        cur = self.focused_message()
        i = views.index(cur) + delta if cur in views else (len(views) - 1 if delta < 0 else None)
        if i is None or i >= len(views):
            return False
        views[max(i, 0)].focus()
        views[max(i, 0)].scroll_visible(animate=False)
        return True
