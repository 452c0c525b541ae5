"""The one place the chat talks to the engine: a worker thread that owns the model, and
ChatModel, which turns a branch's messages into a streamed reply with its statistics.

Today each reply goes through ``m.generate(ids)`` and the engine's prefix cache reuses the
shared prefix; when sequences land, each branch tip keeps its own Sequence (forked at the
branch point), and only this module changes.
"""

from __future__ import annotations

import queue
from collections import deque
import threading
import time
from dataclasses import dataclass
from typing import Callable


# Prompt tokens the engine may recompute on any turn: its prefix cache keeps whole blocks of
# this many tokens (m.kv_stats().block_size, once the engine reports it).
REUSE_BLOCK = 16


@dataclass
class ModelInfo:
    """What the status bar says about the loaded model."""
    name: str
    quant: str
    placement: str      # e.g. "CPU 30/30 layers"
    ctx: int
    load_seconds: float


@dataclass
class ContextUsage:
    """Tokens in the context and the KV memory they take."""
    used: int
    limit: int
    kv_bytes: int
    kv_limit_bytes: int
    kv_type: str


@dataclass
class ReplyStats:
    """One reply's figures, kept with the message."""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_tps: float = 0.0
    generated_tokens: int = 0
    generate_tps: float = 0.0
    time_to_first_token: float = 0.0
    finish_reason: str = ""          # stop, length, context, cancelled
    seed: int = 0
    reuse_note: str = ""             # why prompt tokens were recomputed, if any were

    def as_meta(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Reply:
    text: str
    stats: ReplyStats


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class ChatModel:
    """A loaded model seen from the chat. Call it only from the EngineThread."""

    def __init__(self, model):
        """Args:
            model: a localllm Model (from ``localllm.load``).
        """
        from ..inspect import KV_BYTES_PER_VALUE, describe
        self.model = model
        desc = describe(model.file)
        quant = desc["quant"]
        stem = model.path.stem
        name = stem[: -len(quant) - 1] if stem.lower().endswith("." + quant.lower()) else stem
        n = model.args.n_layers
        self.info = ModelInfo(name=name, quant=quant,
                              placement=f"{model.backend.name.upper()} {n}/{n} layers",
                              ctx=model.ctx, load_seconds=model.load_seconds)
        # Until the engine reports its KV pool (m.kv_stats()), the per-token size from the
        # file's dimensions and the CPU cache's float16 layout.
        self._kv_per_token = desc["kv_bytes_per_1k"] // 1000
        self._kv_type = {2: "f16", 4: "f32"}.get(KV_BYTES_PER_VALUE, f"{KV_BYTES_PER_VALUE} B")
        # Token sequences of recent replies (prompt + reply), the latest last: what the
        # engine has computed, to tell reused, new and recomputed prompt tokens apart.
        self._seen: deque[list[int]] = deque(maxlen=32)

    def count(self, messages: list[dict]) -> int:
        """Tokens of the rendered conversation, with the assistant's turn opened."""
        return len(self.model.chat_tokens(messages)) if messages else 0

    def context(self, used: int) -> ContextUsage:
        return ContextUsage(used=used, limit=self.model.ctx,
                            kv_bytes=used * self._kv_per_token,
                            kv_limit_bytes=self.model.ctx * self._kv_per_token,
                            kv_type=self._kv_type)

    def reply(self, messages: list[dict], sampling: dict, cancel: threading.Event,
              on_chunk: Callable[[str, int], None], cause: str = "") -> Reply:
        """Stream the assistant's answer to ``messages``.

        Args:
            messages: the chat so far (system prompt first, if any).
            sampling: SamplingParams fields; max_tokens < 0 means until the context is full.
            cancel: set by the UI to stop; the text so far is kept.
            on_chunk: called with each piece of text and the tokens generated so far.
            cause: what changed the conversation since the last reply (branch switch, edit,
                system prompt), used to explain recomputed tokens.
        Returns:
            The reply text and its statistics.
        """
        ids = self.model.chat_tokens(messages)
        params = dict(sampling)
        if params.get("max_tokens", -1) < 0:
            params["max_tokens"] = max(self.model.ctx - len(ids), 0)
        gen = self.model.generate(ids, **params)
        t0 = time.perf_counter()
        pieces: list[str] = []
        tokens: list[int] = []
        t_first = t_last = 0.0
        cancelled = False
        try:
            for chunk in gen:
                t_last = time.perf_counter()
                t_first = t_first or t_last
                pieces.append(str(chunk))
                tokens.extend(chunk.tokens)
                on_chunk(str(chunk), len(tokens))
                if cancel.is_set():
                    cancelled = True
                    break
        finally:
            gen.close()
        s = self.model.last_stats
        stats = ReplyStats(prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                           prompt_tps=s.prompt_tps, generated_tokens=len(tokens),
                           time_to_first_token=(t_first - t0) if t_first else 0.0,
                           finish_reason="cancelled" if cancelled else s.finish_reason,
                           seed=s.seed)
        stats.generate_tps = s.generate_tps if not cancelled else (
            (len(tokens) - 1) / (t_last - t_first) if len(tokens) > 1 and t_last > t_first
            else 0.0)
        stats.reuse_note = self._reuse_note(ids, s.cached_tokens, cause)
        self._seen.append(ids + tokens)
        return Reply("".join(pieces), stats)

    def _reuse_note(self, ids: list[int], cached: int, cause: str) -> str:
        """Why prompt tokens that the engine could have known were run again, if any were."""
        if not self._seen:
            return ""
        held = self._seen[-1]
        common = _common_prefix(held, ids)
        best = max(_common_prefix(s, ids) for s in self._seen)
        limit = len(ids) - 1     # the last prompt token always runs, to give logits
        # The last token of a reply is sampled but never run, and the engine's prefix cache
        # reuses whole blocks: a partial block is always redone.
        redone = min(best, limit) - cached
        lead = f"{cause}: " if cause else ""
        if redone > REUSE_BLOCK:
            return (f"{lead}{redone} tokens computed for another branch were computed again "
                    f"(the cache held a branch sharing {common} tokens)")
        if common < min(len(held), limit):
            return lead + (f"the prompt changes from token {common}" if cause else
                           f"the chat template renders the history differently from token "
                           f"{common}")
        return ""


class EngineThread:
    """One daemon thread that runs jobs in order: the model is used from this thread only,
    and quitting never waits for a long prompt to finish."""

    def __init__(self, on_error: Callable[[BaseException], None]):
        self._jobs: queue.Queue = queue.Queue()
        self._on_error = on_error
        self._thread = threading.Thread(target=self._run, name="chat-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except Exception as e:  # reported in the UI; the thread keeps serving
                self._on_error(e)
