"""The chat's engine side: loading the model, the flow of a turn (check the room, store the
prompt, stream the reply into the view, store the reply), stopping it, the context meter,
and the text of /summary. Jobs run on the EngineThread; their results come back as events."""

from __future__ import annotations

import threading
import time
from typing import Callable

from textual.app import App

from .adapter import ChatModel, ContextUsage, EngineThread, ModelInfo, ReplyStats
from .composer import Composer
from .events import (ContextFull, Counted, EngineFailed, Loaded, ReplyChunk, ReplyDone,
                     ReplyRequest, ReplyStarted, ReplyThinking, SummaryDone)
from .state import ChatState
from .store import StoreError
from .tree import Message
from .view import ConversationLog

# A reply needs at least this many tokens of room (or max_tokens, if smaller) to be started.
MIN_REPLY_ROOM = 32
SUMMARY_REQUEST = ("Summarize our conversation so far in one short paragraph: the facts, "
                   "decisions and open questions someone needs to continue it.")
SUMMARY_TOKENS = 256


def context_full_text(drop_hint: int | None = None) -> str:
    """The choices offered when the context is full.

    Args:
        drop_hint: the fewest oldest turns to leave out for the turn to fit, if known.
    Returns:
        One paragraph naming the commands.
    """
    drop = f"/drop {drop_hint}" if drop_hint else "/drop N"
    return (f"Choose: /clear starts a new conversation; {drop} leaves the oldest turns out "
            "of the context (they stay on screen and saved); /summary starts a new branch "
            "from a summary. Nothing is cut without asking.")


class Replies:
    """The model seen from the app: it owns the EngineThread, the loaded ChatModel, whether
    a reply is being written and the event that stops it, and the latest figures (context
    in use, the last reply's statistics). The ``on_*`` methods take the engine's events."""

    def __init__(self, app: App, state: ChatState, view: ConversationLog, composer: Composer,
                 on_status: Callable[[], None]):
        """Args:
            app: the running app, to post events to and to call from the engine thread.
            state: the conversation and its store.
            view: where turns are shown.
            composer: the draft of the next message (where a turn goes, text sent back).
            on_status: redraws the status bar after a change of state.
        """
        self.app, self.state, self.view, self.composer = app, state, view, composer
        self.on_status = on_status
        self.chat_model: ChatModel | None = None
        self.engine = EngineThread(lambda e: app.post_message(EngineFailed(e)))
        self.cancel = threading.Event()
        self.generating = False
        self.last_stats: ReplyStats | None = None
        self.usage: ContextUsage | None = None
        self.load_error = ""
        self._load_started = time.perf_counter()

    # ---- the model ------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo | None:
        return self.chat_model.info if self.chat_model else None

    def start_loading(self, load: Callable[[], object]) -> None:
        """Load the model on the engine thread (``on_loaded`` or ``on_engine_failed`` follows)."""
        self.engine.submit(lambda: self.app.post_message(Loaded(ChatModel(load()))))

    def close(self) -> None:
        """Stop any reply and let the engine thread end after its current job."""
        self.cancel.set()
        self.engine.stop()

    def activity(self, model_label: str) -> str:
        """The status bar's line about the engine (loading, a failed load, writing), or ""."""
        if self.load_error:
            return f"the model did not load: {self.load_error}"
        if self.chat_model is None:
            return (f"loading {model_label}… {time.perf_counter() - self._load_started:.0f} s "
                    "(a first run compiles the kernels: about a minute)")
        if self.generating:
            return "writing… (Esc stops)"
        return ""

    def can_generate(self) -> bool:
        """Whether a reply can start now; if not, says why in a toast."""
        if self.load_error:
            self.app.notify(f"The model did not load: {self.load_error}", severity="error")
            return False
        if self.chat_model is None:
            self.app.notify("The model is still loading.", severity="warning")
            return False
        if self.generating:
            self.app.notify("A reply is being written: Esc stops it.", severity="warning")
            return False
        return True

    def stop_reply(self) -> None:
        """Ask the reply being written to stop; its text so far is kept."""
        self.cancel.set()

    def recount(self) -> None:
        """Count the tokens of the current path on the engine thread (for the meter)."""
        if self.chat_model is None:
            return
        cm, messages = self.chat_model, self.state.conv.prompt()
        self.engine.submit(lambda: self.app.post_message(Counted(cm.context(cm.count(messages)))))

    async def on_loaded(self, event: Loaded) -> None:
        self.chat_model = event.chat_model
        info = event.chat_model.info
        await self.view.remove_note("loading")
        await self.view.note(f"{info.name} {info.quant} loaded in {info.load_seconds:.1f} s "
                             f"(context {info.ctx} tokens). /help lists commands and keys.")
        self.recount()
        head = self.state.conv.head()
        if head is not None and head.role == "user":
            await self.view.note("The last message has no reply (the app stopped while "
                                 "writing it): /regen answers it.")

    def on_counted(self, event: Counted) -> None:
        self.usage = event.usage
        self.on_status()

    # ---- a turn -----------------------------------------------------------------------

    async def send(self, text: str) -> None:
        """Send a user message where the draft says (after the head, as a new branch of an
        edited or unanswered message, or as a new top-level branch) and start its reply."""
        conv = self.state.conv
        target = self.composer.draft.target(conv)
        path = self.state.path_to(target.parent_id)
        await self.view.show(conv, path)
        await self.view.add_prompt(conv, text)
        messages = conv.prompt(path) + [{"role": "user", "content": text}]
        self.start_reply(ReplyRequest(messages, self.state.sampling(), target.cause, text,
                                      target.parent_id))

    async def regenerate(self, user_msg: Message) -> None:
        """A new reply to ``user_msg``, as a sibling of any it has."""
        if not self.can_generate():
            return
        conv = self.state.conv
        conv.select(user_msg.id)
        self.start_reply(ReplyRequest(conv.prompt(self.state.path_to(user_msg.id)),
                                      self.state.sampling(), self.composer.draft.cause or "regen",
                                      None, user_msg.id))

    def start_reply(self, req: ReplyRequest) -> None:
        """Run a turn on the engine thread (its events follow: started, chunks, done)."""
        self.generating, self.composer.draft.cause = True, ""
        self.cancel.clear()
        self.on_status()
        self.engine.submit(lambda: self._reply_job(req))

    def _reply_job(self, req: ReplyRequest) -> None:
        """On the engine thread: check the room, store the prompt, stream the reply."""
        cm, post = self.chat_model, self.app.post_message
        needed = cm.count(req.messages)
        max_tokens = req.sampling.get("max_tokens", -1)
        room = MIN_REPLY_ROOM if max_tokens < 0 else min(max_tokens, MIN_REPLY_ROOM)
        if needed + max(room, 1) > cm.info.ctx:
            post(ContextFull(req, needed, self._drop_hint(req.messages)))
            return
        parent_id = req.parent_id
        if req.user_text is not None:
            parent_id = self.app.call_from_thread(self._store_user, req).id
        post(ReplyStarted(parent_id, cm.context(needed)))
        reply = cm.reply(req.messages, req.sampling, self.cancel,
                         lambda text, n, usage: post(ReplyChunk(text, n, usage)), req.cause,
                         on_reasoning=lambda text, n: post(ReplyThinking(text, n)))
        post(ReplyDone(parent_id, reply))

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
        msg = self.state.store.add_message(self.state.conv, req.parent_id, "user", req.user_text)
        self.view.prompt_stored(self.state.conv, msg)
        self.composer.sent()
        return msg

    async def on_reply_started(self, event: ReplyStarted) -> None:
        await self.view.show(self.state.conv, self.state.path_to(event.parent_id))
        await self.view.start_reply(self.state.conv)
        self.usage = event.usage

    async def on_reply_chunk(self, event: ReplyChunk) -> None:
        await self.view.write(event.text)
        self.usage = event.usage

    def on_reply_thinking(self, event: ReplyThinking) -> None:
        self.view.think(event.text, event.tokens)

    async def on_reply_done(self, event: ReplyDone) -> None:
        view = self.view.take_reply()
        self.generating = False
        reply = event.reply
        if view is not None:
            await view.end_stream()
        if view is not None:
            view.thought(reply.stats.reasoning_tokens)
        if reply.text or reply.reasoning or reply.stats.finish_reason != "cancelled":
            conv = self.state.conv
            meta = reply.stats.as_meta()
            if reply.reasoning:   # kept to be shown again, never sent back to the model
                meta["reasoning"] = reply.reasoning
            try:
                msg = self.state.store.add_message(conv, event.parent_id, "assistant",
                                                   reply.text, meta)
            except StoreError as e:  # e.g. a full disk: the reply stays on screen only
                await self.view.note(f"{e}: this reply is shown but not stored.", error=True)
            else:
                if view is not None:
                    view.message = msg
                    self.view.refresh_header(conv, view)
        elif view is not None:
            await view.remove()
            await self.view.note("Stopped before any text was written; /regen tries again.")
        self.last_stats = reply.stats
        self.usage = reply.usage
        if reply.stats.finish_reason == "context":
            await self.view.note(context_full_text(), error=True)
        self.on_status()

    async def on_context_full(self, event: ContextFull) -> None:
        self.generating = False
        req = event.request
        await self.view.show(self.state.conv, self.state.path_to(req.parent_id))
        if req.user_text is not None:
            self.composer.give_back(req.user_text)
        limit = self.chat_model.info.ctx
        await self.view.note(f"The context is full: this turn needs {event.needed} tokens plus "
                             f"room for the reply, and the context holds {limit}. "
                             + context_full_text(event.drop_hint)
                             + (" Your message is back in the box." if req.user_text else ""),
                             error=True)
        self.on_status()

    async def on_engine_failed(self, event: EngineFailed) -> None:
        self.generating = False
        view = self.view.take_reply()
        if view is not None:
            await view.end_stream()
        err = event.error
        msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if self.chat_model is None:
            self.load_error = msg
            await self.view.remove_note("loading")
            await self.view.note(f"error: cannot load {self.state.options.model_label}: {msg}",
                                 error=True)
        else:
            await self.view.note(f"error: {msg}", error=True)
        self.on_status()

    # ---- /summary ---------------------------------------------------------------------

    async def summarize(self) -> None:
        """Write a summary of the current branch on the engine thread (``on_summary_done``
        offers it in the box)."""
        if not self.can_generate():
            return
        cm, messages = self.chat_model, self.state.conv.prompt()
        sampling = self.state.sampling()
        limit = sampling.get("max_tokens", -1)   # the user's reply limit bounds it too
        sampling["max_tokens"] = SUMMARY_TOKENS if limit < 0 else min(limit, SUMMARY_TOKENS)
        self.generating = True
        self.cancel.clear()
        await self.view.note("Summarizing this branch…", key="summary")
        post, cancel = self.app.post_message, self.cancel

        def job():
            system = messages[:1] if messages and messages[0]["role"] == "system" else []
            turns = messages[len(system):]
            ask = [{"role": "user", "content": SUMMARY_REQUEST}]
            while turns and cm.count(system + turns + ask) + sampling["max_tokens"] > cm.info.ctx:
                turns = turns[2:]   # the oldest turns that no longer fit
            reply = cm.reply(system + turns + ask, sampling, cancel,
                             lambda text, n, usage: None, "summary")
            post(SummaryDone(reply.text.strip()))
        self.engine.submit(job)

    async def on_summary_done(self, event: SummaryDone) -> None:
        self.generating = False
        await self.view.remove_note("summary")
        self.composer.offer_summary(event.text)
        await self.view.note("The summary is in the box: edit it, add your message, and Enter "
                             "starts a new branch from it (the old one stays: /branch).")
        self.on_status()
