"""The public Python API: load a GGUF model and tokenize, score, generate and chat with it.

    >>> m = localllm.load("smollm2-135m")
    >>> print("".join(m.chat([{"role": "user", "content": "Hi"}], max_tokens=20)))

A model serves many sequences at once (``new_sequence``); each generation without one makes
its own, so interleaved generators never disturb each other, and the paged KV cache reuses
the blocks of any earlier prompt that shares a prefix.
"""

from __future__ import annotations

import copy
import hashlib
import os
import time
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Callable, Iterator, Sequence as Seq

import numpy as np

from . import fetch
from .chat_template import ChatTemplate
from .generate import Chunk, Decoder, GenerationStats, run_generation
from .gguf import GGUFFile
from .models import build, module_for
from .models.common import Placement, WeightLoader, check_blocks
from .sampling import SamplingParams
from .sequence import EngineError, KVSpace, KVStats, Runner, Sequence
from .tokenizer import Tokenizer

DEFAULT_CTX = 4096
KV_TYPES = ("f16", "bf16", "q8_0", "q4_0", "fp8")
# Default pool: room for this many full contexts (one request's, plus cached prefixes).
_POOL_CONTEXTS = 2
_MEMORY_MARGIN = 256 << 20

__all__ = ["EngineError", "Generation", "KVStats", "LoadSettings", "Model", "Sequence",
           "load"]


@dataclass
class LoadSettings:
    """How to load and run a model."""
    ctx_size: int = 0            # 0: min(4096, the model's training context)
    threads: int = 0             # 0: the number of physical cores
    batch_size: int = 256        # prompt tokens per forward pass
    chat_template: str | None = None   # builtin name or file; None: the file's own
    backend: str = "cpu"
    models_dir: str | None = None      # model cache directory override
    download: bool = True              # fetch known model names when not cached
    weight_cache: bool = True          # keep repacked weights on disk for faster loads
    ctk: str = "f16"                   # KV cache type of keys ...
    ctv: str = "f16"                   # ... and of values (see KV_TYPES)
    kv_block_size: int = 16            # tokens per KV block (a multiple of 16)
    kv_pool_mb: float = 0              # KV pool limit; 0: two contexts, as memory allows
    # Build missing compiled kernels in parallel worker processes, reporting (done, total)
    # here (None: compile in-process on first use).
    compile_progress: Callable[[int, int], None] | None = None


def _check_kv_types(ctk: str, ctv: str) -> None:
    for name, t in (("ctk", ctk), ("ctv", ctv)):
        if t not in KV_TYPES:
            raise EngineError(f"unknown KV type {t!r} for {name} (choose from "
                              f"{', '.join(KV_TYPES)})")


def physical_cores() -> int:
    try:
        import psutil
        n = psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover - psutil is a dependency
        n = None
    return n or os.cpu_count() or 1


def _make_backend(settings: LoadSettings):
    if settings.backend != "cpu":
        raise EngineError(f"unknown backend {settings.backend!r} (available: cpu)")
    from .backends.cpu import CpuBackend
    cache = fetch.cache_dir(settings.models_dir).parent / "packed" if settings.weight_cache else None
    return CpuBackend(threads=settings.threads or physical_cores(), weight_cache=cache,
                      compile_progress=settings.compile_progress)


def kv_bytes_per_token(args, backend, ctk: str = "f16", ctv: str = "f16",
                       block_size: int = 16) -> int:
    """KV bytes one token takes in every layer, for the given KV types."""
    from .backends.base import KVLayout
    layout = KVLayout(args.n_kv_heads, args.head_dim, block_size, ctk, ctv)
    return args.n_layers * backend.kv_block_nbytes(layout) // block_size


def memory_needed(file: GGUFFile, args, ctx: int, backend=None, ctk: str = "f16",
                  ctv: str = "f16") -> tuple[int, int]:
    """Bytes a model will hold in memory: (weights, KV cache of ``ctx`` tokens).

    Weights are copied into the kernels' layout, except a token embedding table that has a
    separate output matrix (its rows are read from the mapped file as tokens need them).
    The KV cache is counted full, as a long conversation will fill it.
    """
    weights = sum(t.nbytes for t in file.tensors.values())
    if "output.weight" in file.tensors and "token_embd.weight" in file.tensors:
        weights -= file.tensors["token_embd.weight"].nbytes
    if backend is None:
        from .backends.cpu import CpuBackend as backend
    return weights, ctx * kv_bytes_per_token(args, backend, ctk, ctv)


def _available_memory() -> int:
    import psutil
    return psutil.virtual_memory().available


def check_memory(file: GGUFFile, args, ctx: int, available: int | None = None,
                 backend=None, ctk: str = "f16", ctv: str = "f16") -> None:
    """Raises EngineError, before any weight is loaded, when the weights and a full KV cache
    of ``ctx`` tokens would not fit in the memory available now."""
    weights, kv = memory_needed(file, args, ctx, backend, ctk, ctv)
    if available is None:
        available = _available_memory()
    if weights + kv > available:
        gb = 1 << 30
        hint = " (try a smaller --ctx-size)" if kv > available // 4 else ""
        raise EngineError(
            f"not enough memory: the model needs {weights / gb:.2f} GiB for weights and "
            f"{kv / gb:.2f} GiB for a {ctx}-token KV cache, {available / gb:.2f} GiB is "
            f"available{hint}")


def pool_tokens(settings: LoadSettings, ctx: int, per_token: int, weights: int,
                available: int | None = None) -> int:
    """Tokens the KV pool may hold: --kv-pool-mb's worth (at least one context), else two
    contexts where memory allows, one at the least."""
    if settings.kv_pool_mb:
        n = int(settings.kv_pool_mb * (1 << 20)) // per_token
        if n < ctx:
            raise EngineError(
                f"--kv-pool-mb {settings.kv_pool_mb:g} holds {n} tokens of KV, less than the "
                f"{ctx}-token context ({ctx * per_token / (1 << 20):.1f} MB); raise it or "
                "lower --ctx-size")
        return n
    if available is None:
        available = _available_memory()
    spare = (available - weights - _MEMORY_MARGIN) // per_token
    return max(ctx, min(_POOL_CONTEXTS * ctx, spare))


def file_identity(path: Path) -> bytes:
    """A GGUF file's identity for the prefix cache: its size, head and tail."""
    size = path.stat().st_size
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    with open(path, "rb") as f:
        h.update(f.read(1 << 16))
        f.seek(max(0, size - (1 << 16)))
        h.update(f.read(1 << 16))
    return h.digest()


@dataclass
class Decoding:
    """A generation under way: its Decoder and the Sequence it runs in (released at the end
    when the generation made it)."""
    decoder: Decoder
    seq: Sequence
    own: bool
    prompted: bool = False   # the prompt has run (batching.Batcher's bookkeeping)

    def close(self) -> None:
        if self.own:
            self.seq.release()


class Generation:
    """A running generation: iterate it for Chunk pieces; ``stats`` fills in as it goes,
    ``close()`` stops it early (its blocks go back to the pool at once)."""

    def __init__(self, chunks: Iterator[Chunk], stats: GenerationStats):
        self._chunks = chunks
        self.stats = stats

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()


class Model:
    """A loaded model: tokenizer, chat template, placed layers and the paged KV cache."""

    def __init__(self, path: str | os.PathLike, settings: LoadSettings | None = None):
        t0 = time.perf_counter()
        self.settings = s = settings or LoadSettings()
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        meta = self.file.metadata
        self.metadata = meta
        module = module_for(meta)  # an unsupported architecture fails before any other work
        args = module.ModelArgs.from_gguf(meta, meta["general.architecture"])
        check_blocks(self.file.tensors, args.arch, args.n_layers)  # before sizing the KV cache
        ctx = s.ctx_size or min(DEFAULT_CTX, args.context_length)
        if ctx <= 0:
            raise EngineError(f"context size must be positive, got {ctx}")
        _check_kv_types(s.ctk, s.ctv)  # before any work
        self.backend = _make_backend(s)
        per_token = kv_bytes_per_token(args, self.backend, s.ctk, s.ctv, s.kv_block_size)
        check_memory(self.file, args, ctx, backend=self.backend, ctk=s.ctk, ctv=s.ctv)
        weights, _ = memory_needed(self.file, args, ctx, self.backend, s.ctk, s.ctv)
        n_pool = pool_tokens(s, ctx, per_token, weights)
        self.backend.begin_model(self.path)  # may read stored weights while the rest builds
        self.tokenizer = Tokenizer.from_metadata(meta)
        self.template = ChatTemplate.resolve(meta, s.chat_template)
        placement = Placement.single(self.backend, args.n_layers)
        self.net = build(meta, WeightLoader(self.file, placement), args)
        self.backend.end_model()
        self.args = self.net.args
        self.vocab_size = self.args.vocab_size
        self.ctx = ctx
        self._pool_tokens = n_pool
        self._identity = file_identity(self.path)
        self.kv, self._runner = self._new_cache(s.ctk, s.ctv)
        self.last_stats = GenerationStats()
        self.load_seconds = time.perf_counter() - t0

    # ---- text <-> tokens ------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Seq[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def chat_tokens(self, messages: list[dict], **extra) -> list[int]:
        """Token ids of a rendered conversation: the template's special tokens are parsed,
        text typed inside messages never becomes a control token, BOS is added once."""
        text, spans = self.template.render_with_spans(messages, **extra)
        ids = self.tokenizer.encode(text, add_special=False, parse_special=True,
                                    literal_spans=spans)
        bos = self.tokenizer.bos_id
        if self.tokenizer.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    # ---- sequences and the cache ------------------------------------------------------

    def _new_cache(self, ctk: str, ctv: str) -> tuple[KVSpace, Runner]:
        _check_kv_types(ctk, ctv)
        try:
            space = KVSpace(self.net, ctk, ctv, self.settings.kv_block_size, self._pool_tokens,
                            self._identity)
        except ValueError as e:
            raise EngineError(str(e)) from None
        return space, Runner(self.net, space, self.ctx, self.settings.batch_size,
                             self.vocab_size)

    def with_kv(self, ctk: str, ctv: str) -> "Model":
        """The same loaded model (weights, tokenizer, template shared) over a cache of its
        own in other KV types, e.g. to compare their quality in one process."""
        other = copy.copy(self)
        other.kv, other._runner = self._new_cache(ctk, ctv)
        other.last_stats = GenerationStats()
        return other

    def new_sequence(self) -> Sequence:
        """An empty per-request state (tokens and block tables) on this model."""
        return Sequence(self._runner)

    def kv_stats(self) -> KVStats:
        """Blocks used, cached and free, and the bytes per token of the KV types."""
        return self.kv.stats()

    def forget_cached(self) -> None:
        """Drop the cached prefixes of finished requests (the next prompts run in full)."""
        self.kv.cache.forget_cached()

    def step(self, items: list[tuple[Sequence, list[int], bool | None]]) -> list:
        """One forward pass over several sequences' new tokens (continuous batching, a
        speculative verification): see sequence.Runner.step."""
        return self._runner.step(items)

    # ---- scoring and generation -----------------------------------------------------

    def logits(self, ids: Seq[int]) -> np.ndarray:
        """Teacher-forced logits of every position, computed afresh (no cached prefix).

        Returns:
            float32 (len(ids), vocab_size).
        """
        if len(ids) > self.ctx:
            raise EngineError(f"{len(ids)} tokens exceed the context size {self.ctx}")
        with self.new_sequence() as seq:
            return seq.feed(ids, all_logits=True)

    def generate(self, prompt: str | Seq[int], seq: Sequence | None = None, constraint=None,
                 **sampling) -> Generation:
        """Stream a continuation of a prompt (text, tokenized with BOS per the model, or ids).

        Args:
            prompt: text or token ids.
            seq: the sequence to continue (its KV for the common prefix is reused, and it
                holds the prompt and the output afterwards); None: a fresh one, released
                at the end.
            constraint: optional TokenConstraint over ``token_vocab`` (e.g.
                TokenConstraint.json_schema(schema, m.token_vocab)); used up by one call.
            **sampling: SamplingParams fields (temperature, top_k, ..., seed, max_tokens, stop).
        Returns:
            A Generation: Chunk pieces of text (str) carrying .tokens, .logprobs and, on the
            last, .finish_reason.
        """
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return self._generate(ids, self._params(sampling), seq, constraint=constraint)

    def chat(self, messages: list[dict], seq: Sequence | None = None,
             context_shift: bool = False, constraint=None, **sampling) -> Generation:
        """Stream the assistant's reply to a conversation, using the chat template.

        Args:
            messages: [{"role", "content"}, ...].
            seq: as for generate.
            context_shift: when the conversation does not fit, or fills up while replying,
                drop its oldest turns (after any system message) instead of failing or
                stopping; ``stats.dropped_messages`` counts them.
            constraint: as for generate.
            **sampling: SamplingParams fields.
        """
        params = self._params(sampling)
        if not context_shift:
            return self._generate(self.chat_tokens(messages), params, seq,
                                  constraint=constraint)
        return self._shifting_chat(list(messages), params, seq, constraint)

    @cached_property
    def token_vocab(self):
        """The vocabulary as constraints see it (localllm.constrain.TokenVocab), built once."""
        from .constrain import TokenVocab
        return TokenVocab.from_tokenizer(self.tokenizer)

    def _params(self, sampling: dict) -> SamplingParams:
        names = {f.name for f in fields(SamplingParams)}
        unknown = set(sampling) - names
        if unknown:
            raise TypeError(f"unknown sampling settings: {', '.join(sorted(unknown))}")
        p = SamplingParams(**sampling)
        p.validate()
        return p

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise EngineError("the prompt is empty")
        if len(ids) >= self.ctx:
            raise EngineError(f"the prompt has {len(ids)} tokens but the context holds {self.ctx}; "
                              "use a larger context size (-c) or a shorter prompt")

    def _generate(self, ids: list[int], params: SamplingParams, seq: Sequence | None,
                  shift=None, stats: GenerationStats | None = None,
                  constraint=None) -> Generation:
        self._check_prompt(ids)
        if seq is not None:
            seq._check()
        stats = stats or GenerationStats()
        self.last_stats = stats
        return Generation(self._run(ids, params, seq, stats, shift, constraint), stats)

    def _run(self, ids, params, seq, stats, shift, constraint) -> Iterator[Chunk]:
        d = self._start(ids, params, seq, stats, shift, constraint)
        try:
            yield from run_generation(d.seq.feed, d.decoder)
        finally:
            d.close()

    def start(self, prompt: str | Seq[int], seq: Sequence | None = None, constraint=None,
              **sampling) -> "Decoding":
        """A generation to drive step by step (batching.Batcher does): the prompt is matched
        against the cache now; see generate for the arguments."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_prompt(ids)
        stats = GenerationStats()
        self.last_stats = stats
        return self._start(ids, self._params(sampling), seq, stats, None, constraint)

    def _start(self, ids, params, seq, stats, shift, constraint) -> "Decoding":
        own = seq is None
        if own:
            seq = self.new_sequence()
        else:
            seq._check()
        cached = self._runner.reuse(seq, ids)

        def make_room(generated):
            made = shift(generated)
            if made is None:
                return None
            new_ids, room = made
            fresh = self.new_sequence()
            logits = fresh.feed(new_ids)
            seq.adopt(fresh)  # positions changed: the shortened conversation anew
            return logits, room

        # Constrained text is checked byte for byte: decoded without space cleaning.
        stream = self.tokenizer.stream(continuation=True, clean_spaces=constraint is None)
        decoder = Decoder(ids, cached, self.ctx - len(ids), params, self.vocab_size, stream,
                          self.tokenizer.is_eog, stats, self.backend.logsumexp,
                          lambda: self.kv.cache.checkpoint(seq.kv),
                          make_room if shift is not None else None, constraint)
        return Decoding(decoder, seq, own)

    def _shifting_chat(self, messages: list[dict], params: SamplingParams,
                       seq: Sequence | None, constraint=None) -> Generation:
        """chat() with the oldest turns dropped as needed to fit the context."""
        first = 1 if messages and messages[0].get("role") == "system" else 0
        stats = GenerationStats()
        dropped = 0

        def fit(extra: list[int]) -> list[int] | None:
            nonlocal dropped
            while True:
                ids = self.chat_tokens(messages[:first] + messages[first + dropped:]) + extra
                if len(ids) < self.ctx - 16 or first + dropped >= len(messages) - 1:
                    return ids if len(ids) < self.ctx else None
                dropped += 1
                stats.dropped_messages = dropped

        ids = fit([])
        if ids is None:
            raise EngineError("the last message alone does not fit in the context; use a "
                              "larger context size (-c)")

        def shift(generated: list[int]):
            before = dropped
            new = fit(list(generated))
            if new is None or dropped == before:
                return None
            return new, self.ctx - len(new)

        return self._generate(ids, params, seq, shift, stats, constraint)

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load(path_or_name: str | os.PathLike | None = None, **settings) -> Model:
    """Load a GGUF model by path or known name (fetched and cached on first use).

    Args:
        path_or_name: a .gguf path, a known model name (see ``llm list``), or None for the
            default model.
        **settings: LoadSettings fields (ctx_size, threads, batch_size, chat_template, ctk,
            ctv, kv_block_size, kv_pool_mb, ...).
    Returns:
        A Model.
    """
    names = {f.name for f in fields(LoadSettings)}
    unknown = set(settings) - names
    if unknown:
        raise TypeError(f"unknown load settings: {', '.join(sorted(unknown))}")
    s = LoadSettings(**settings)
    path = fetch.resolve_model_path(path_or_name, s.models_dir, download=s.download)
    return Model(path, s)
