"""The one place the chat talks to the engine: a worker thread that owns the model, and
ChatModel, which turns a branch's messages into a streamed reply with its statistics.

Each branch tip keeps its own engine Sequence: a turn continues the tip it extends, and a
new branch (a regenerated reply, an edited message) forks the closest tip, sharing the KV
of the common prefix copy-on-write, so moving between branches recomputes nothing.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

from localllm.text.reasoning import ReasoningSplitter, style_of_template

# What the app did before a turn (ReplyRequest.cause), as the reuse note names it; the
# history changes make every token after the change new, the rest are branch moves.
CAUSES = {"branch": "branch switch", "edit": "edited message", "regen": "regenerated reply",
          "summary": "new branch from a summary", "load": "another conversation",
          "system": "the system prompt changed", "drop": "turns were dropped from the context"}
HISTORY_CHANGES = ("system", "drop")

# Kept branch tips: beyond this, or when the KV pool runs short, the least recently used
# tips are released (their full blocks stay in the engine's prefix cache).
MAX_TIPS = 8


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
    """Tokens in the context, and the KV memory of every kept branch in the engine's pool."""
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
    draft_tokens: int = 0            # speculative decoding: drafted tokens checked, ...
    accepted_tokens: int = 0         # ... those accepted, ...
    tokens_per_pass: float = 0.0     # ... tokens per forward pass, and the speedup over
    speedup: float = 0.0             # plain decoding (0: not measured)
    reasoning_tokens: int = 0        # of generated_tokens, those that wrote the thinking

    def as_meta(self) -> dict:
        return dict(self.__dict__)


@dataclass
class Reply:
    text: str                        # the answer (a reasoning model's thinking apart)
    stats: ReplyStats
    usage: ContextUsage
    reasoning: str = ""


class _Thinking:
    """A reply's thinking apart from its answer (<think> tags, harmony channels)."""

    def __init__(self, model, messages: list[dict], on_reasoning):
        self.splitter = ReasoningSplitter(style_of_template(model.template.source),
                                          model.render_chat(messages))
        self.on_reasoning = on_reasoning
        self.text: list[str] = []
        self.tokens = 0

    def feed(self, piece: str, n_tokens: int) -> str:
        """Returns: the answer's text in a piece (its thinking goes to on_reasoning)."""
        was = self.splitter.in_reasoning
        parts = self.splitter.feed(piece)
        if was or self.splitter.in_reasoning or any(p.kind == "reasoning" for p in parts):
            self.tokens += n_tokens
        return self._route(parts)

    def finish(self) -> str:
        return self._route(self.splitter.finish())

    def _route(self, parts) -> str:
        answer = []
        for p in parts:
            if p.kind == "reasoning":
                self.text.append(p.text)
                if self.on_reasoning is not None:
                    self.on_reasoning(p.text, self.tokens)
            elif p.kind == "content":
                answer.append(p.text)
            else:   # a harmony call to a function: the chat has no tools, show it as text
                answer.append(f"{p.name} {p.text}")
        return "".join(answer)


def _common_prefix(a, b) -> int:
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
        from localllm.formats.inspect import describe
        self.model = model
        quant = describe(model.file)["quant"]
        stem = model.path.stem
        name = stem[: -len(quant) - 1] if stem.lower().endswith("." + quant.lower()) else stem
        per_backend = Counter(layer.backend.name.upper() for layer in model.net.layers)
        n = len(model.net.layers)
        self.info = ModelInfo(name=name, quant=quant,
                              placement=" · ".join(f"{b} {k}/{n} layers"
                                                   for b, k in per_backend.items()),
                              ctx=model.ctx, load_seconds=model.load_seconds)
        self._tips: list = []        # Sequences at branch tips, least recently used first
        # Token sequences of recent replies (prompt + reply): what was computed before, to
        # tell reused, new and recomputed prompt tokens apart.
        self._seen: deque[list[int]] = deque(maxlen=32)

    def count(self, messages: list[dict]) -> int:
        """Tokens of the rendered conversation, with the assistant's turn opened."""
        return len(self.model.chat_tokens(messages)) if messages else 0

    def context(self, used: int) -> ContextUsage:
        k = self.model.kv_stats()
        kv_type = k.k_type if k.k_type == k.v_type else f"{k.k_type}/{k.v_type}"
        return ContextUsage(used=used, limit=self.model.ctx, kv_bytes=k.used_bytes,
                            kv_limit_bytes=k.blocks_total * k.block_size * k.bytes_per_token,
                            kv_type=kv_type)

    def reply(self, messages: list[dict], sampling: dict, cancel: threading.Event,
              on_chunk: Callable[[str, int, ContextUsage], None], cause: str = "",
              on_reasoning: Callable[[str, int], None] | None = None) -> Reply:
        """Stream the assistant's answer to ``messages``.

        Args:
            messages: the chat so far (system prompt first, if any).
            sampling: SamplingParams fields; max_tokens < 0 means until the context is full.
            cancel: set by the UI to stop; the text so far is kept.
            on_chunk: called with each piece of text, the tokens generated so far and the
                context in use.
            cause: a key of CAUSES (or ""): what the app did before this turn, to explain
                recomputed tokens.
            on_reasoning: called with each piece of a reasoning model's thinking and the
                tokens of thinking so far (the thinking is never passed to on_chunk).
        Returns:
            The reply text, its statistics and the context in use after it.
        """
        ids = self.model.chat_tokens(messages)
        params = dict(sampling)
        if params.get("max_tokens", -1) < 0:
            params["max_tokens"] = max(self.model.ctx - len(ids), 0)
        seq, base = self._sequence_for(ids, params["max_tokens"])
        t0 = time.perf_counter()
        pieces: list[str] = []
        tokens: list[int] = []
        t_first = t_last = 0.0
        cancelled = False
        thinking = _Thinking(self.model, messages, on_reasoning)
        try:
            gen = self.model.generate(ids, seq=seq, **params)
            try:
                for chunk in gen:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                    tokens.extend(chunk.tokens)
                    text = thinking.feed(str(chunk), len(chunk.tokens))
                    pieces.append(text)
                    if text:
                        on_chunk(text, len(tokens), self.context(len(ids) + len(tokens)))
                    if cancel.is_set():
                        cancelled = True
                        break
                rest = thinking.finish()
                if rest:
                    pieces.append(rest)
                    on_chunk(rest, len(tokens), self.context(len(ids) + len(tokens)))
            finally:
                gen.close()
        finally:
            self._keep(seq)
        s = gen.stats
        finish = "cancelled" if cancelled else s.finish_reason
        if finish == "length" and len(ids) + len(tokens) >= self.model.ctx:
            finish = "context"
        stats = ReplyStats(prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                           prompt_tps=s.prompt_tps, generated_tokens=len(tokens),
                           time_to_first_token=(t_first - t0) if t_first else 0.0,
                           finish_reason=finish, seed=s.seed, draft_tokens=s.draft_tokens,
                           accepted_tokens=s.accepted_tokens,
                           tokens_per_pass=s.tokens_per_pass, speedup=s.speedup,
                           reasoning_tokens=min(thinking.tokens, len(tokens)))
        stats.generate_tps = s.generate_tps if not cancelled else (
            (len(tokens) - 1) / (t_last - t_first) if len(tokens) > 1 and t_last > t_first
            else 0.0)
        stats.reuse_note = self._reuse_note(ids, base, s.cached_tokens, cause)
        self._seen.append(ids + tokens)
        return Reply("".join(pieces), stats, self.context(len(ids) + len(tokens)),
                     "".join(thinking.text))

    def _sequence_for(self, ids: list[int], max_tokens: int):
        """The Sequence to run ``ids`` on, and the tokens it held: the tip sharing the
        longest prefix, itself when ``ids`` extends it, else a fork of it (the tip stays
        for its own branch)."""
        best, n = None, 0
        for tip in self._tips:
            k = _common_prefix(tip.tokens, ids)
            if k > n:
                best, n = tip, k
        if best is None:
            seq, base = self.model.new_sequence(), []
        elif n >= len(best):
            self._tips.remove(best)
            seq, base = best, list(best.tokens)
        else:
            seq, base = best.fork(), list(best.tokens)
        self._make_room(len(ids) - n + max_tokens)
        return seq, base

    def _make_room(self, tokens: int) -> None:
        """Release the least recently used tips while the pool has less room than
        ``tokens`` (at most a context) in free or merely cached blocks."""
        need = min(tokens, self.model.ctx)
        while self._tips:
            k = self.model.kv_stats()
            if (k.blocks_free + k.blocks_cached) * k.block_size >= need:
                return
            self._tips.pop(0).release()

    def _keep(self, seq) -> None:
        """Make ``seq`` the most recent tip; drop tips it makes redundant (a prefix of it)."""
        tokens = seq.tokens
        for tip in list(self._tips):
            if len(tip) <= len(tokens) and tokens[:len(tip)] == tip.tokens:
                self._tips.remove(tip)
                tip.release()
        self._tips.append(seq)
        while len(self._tips) > MAX_TIPS:
            self._tips.pop(0).release()

    def _reuse_note(self, ids: list[int], base: list[int], cached: int, cause: str) -> str:
        """Why prompt tokens that were computed before were run again, if any were."""
        if not self._seen:
            return ""
        best = max(_common_prefix(s, ids) for s in self._seen)
        # The last prompt token always runs; the last token of a reply is sampled, never run.
        redone = min(best, len(ids) - 1) - cached - 1
        lead = f"{CAUSES[cause]}: " if cause else ""
        if redone > 0:
            return (f"{lead}{redone} tokens computed before were computed again (their "
                    "branch's KV was no longer kept)")
        common = _common_prefix(base, ids)
        if common < len(base) and cause in HISTORY_CHANGES:
            return f"{lead}the prompt differs from the cached one from token {common}"
        if common < len(base) and not cause:
            return ("the chat template renders the history differently from how it was "
                    f"generated, from token {common}")
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
