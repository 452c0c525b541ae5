"""The public Python API: load a GGUF model and tokenize, score, generate and chat with it.

    >>> m = localllm.load("smollm2-135m")
    >>> print("".join(m.chat([{"role": "user", "content": "Hi"}], max_tokens=20)))
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from . import fetch
from .chat_template import ChatTemplate
from .generate import Chunk, GenerationStats, run_generation
from .gguf import GGUFFile
from .models import build, module_for
from .models.common import WeightLoader
from .sampling import SamplingParams
from .tokenizer import Tokenizer

DEFAULT_CTX = 4096


class EngineError(ValueError):
    """A request the engine cannot serve (e.g. a prompt longer than the context)."""


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
    return CpuBackend(threads=settings.threads or physical_cores(), weight_cache=cache)


def memory_needed(file: GGUFFile, args, ctx: int, backend=None) -> tuple[int, int]:
    """Bytes a model will hold in memory: (weights, KV cache of ``ctx`` tokens).

    Weights are copied into the kernels' layout, except a token embedding table that has a
    separate output matrix (its rows are read from the mapped file as tokens need them).
    The KV cache (the backend's, default the CPU one) is counted full, as a long
    conversation will fill it.
    """
    weights = sum(t.nbytes for t in file.tensors.values())
    if "output.weight" in file.tensors and "token_embd.weight" in file.tensors:
        weights -= file.tensors["token_embd.weight"].nbytes
    if backend is None:
        from .backends.cpu import CpuBackend as backend
    kv = args.n_layers * backend.kv_cache_nbytes(args.n_kv_heads, args.head_dim, ctx)
    return weights, kv


def check_memory(file: GGUFFile, args, ctx: int, available: int | None = None,
                 backend=None) -> None:
    """Raises EngineError, before any weight is loaded, when the weights and a full KV cache
    of ``ctx`` tokens would not fit in the memory available now."""
    weights, kv = memory_needed(file, args, ctx, backend)
    if available is None:
        import psutil
        available = psutil.virtual_memory().available
    if weights + kv > available:
        gb = 1 << 30
        hint = " (try a smaller --ctx-size)" if kv > available // 4 else ""
        raise EngineError(
            f"not enough memory: the model needs {weights / gb:.2f} GiB for weights and "
            f"{kv / gb:.2f} GiB for a {ctx}-token KV cache, {available / gb:.2f} GiB is "
            f"available{hint}")


class Session:
    """A KV cache and the tokens it holds; new prompts reuse the longest cached prefix."""

    def __init__(self, model: "Model", ctx: int):
        self.model = model
        self.ctx = ctx
        self.cache = model.net.new_cache(ctx)
        self.tokens: list[int] = []

    def reusable(self, ids: Sequence[int]) -> int:
        """How many leading tokens of ``ids`` are already in the cache (at most len - 1, so
        the last token is always run to produce logits)."""
        n = 0
        limit = min(len(self.tokens), len(ids) - 1)
        while n < limit and self.tokens[n] == ids[n]:
            n += 1
        return n

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def feed(self, ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to the cache and return logits.

        Args:
            ids: tokens following those cached.
            all_logits: return every position's logits instead of the last one's.
        Returns:
            float32 (vocab,) or (len(ids), vocab).
        """
        ids = [int(i) for i in ids]
        if not ids:
            raise EngineError("nothing to process")
        start = len(self.tokens)
        if start + len(ids) > self.ctx:
            raise EngineError(f"{start + len(ids)} tokens exceed the context size {self.ctx}")
        vocab = self.model.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise EngineError(f"token id {t} is outside the vocabulary (0..{vocab - 1})")
        net, be = self.model.net, self.model.backend
        bs = max(1, self.model.settings.batch_size)
        outs = []
        for s in range(0, len(ids), bs):
            chunk = ids[s:s + bs]
            pos = np.arange(start + s, start + s + len(chunk), dtype=np.int64)
            rows = range(len(chunk)) if all_logits else ([len(chunk) - 1] if s + bs >= len(ids) else [])
            y = net.forward(np.asarray(chunk, np.int64), pos, self.cache, list(rows))
            if y is not None:
                outs.append(be.to_numpy(y))
            self.tokens.extend(chunk)
        out = np.concatenate(outs) if len(outs) > 1 else outs[0]
        return out if all_logits else out[-1]


class Model:
    """A loaded model: tokenizer, chat template, weights on a backend, and one session."""

    def __init__(self, path: str | os.PathLike, settings: LoadSettings | None = None):
        t0 = time.perf_counter()
        self.settings = settings or LoadSettings()
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        meta = self.file.metadata
        self.metadata = meta
        module = module_for(meta)  # an unsupported architecture fails before any other work
        args = module.ModelArgs.from_gguf(meta, meta["general.architecture"])
        ctx = self.settings.ctx_size or min(DEFAULT_CTX, args.context_length)
        if ctx <= 0:
            raise EngineError(f"context size must be positive, got {ctx}")
        self.backend = _make_backend(self.settings)
        check_memory(self.file, args, ctx, backend=self.backend)
        self.backend.begin_model(self.path)  # may read stored weights while the rest builds
        self.tokenizer = Tokenizer.from_metadata(meta)
        self.template = ChatTemplate.resolve(meta, self.settings.chat_template)
        self.net = build(meta, WeightLoader(self.file, self.backend), args)
        self.backend.end_model()
        self.args = self.net.args
        self.vocab_size = self.args.vocab_size
        self.ctx = ctx
        self.session = Session(self, ctx)
        self.last_stats = GenerationStats()
        self.load_seconds = time.perf_counter() - t0

    # ---- text <-> tokens ------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
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

    # ---- scoring and generation -----------------------------------------------------

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits of every position, from an empty cache.

        Returns:
            float32 (len(ids), vocab_size).
        """
        if len(ids) > self.ctx:
            raise EngineError(f"{len(ids)} tokens exceed the context size {self.ctx}")
        self.session.truncate(0)
        return self.session.feed(ids, all_logits=True)

    def generate(self, prompt: str | Sequence[int], constraint=None, **sampling) -> Iterator[Chunk]:
        """Stream a continuation of a prompt (text, tokenized with BOS per the model, or ids).

        Args:
            prompt: text or token ids.
            constraint: optional TokenConstraint over ``token_vocab`` (e.g.
                TokenConstraint.json_schema(schema, m.token_vocab)); used up by one call.
            **sampling: SamplingParams fields (temperature, top_k, ..., seed, max_tokens, stop).
        Yields:
            Chunk pieces of text (str) carrying .tokens and .logprobs.
        """
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return self._generate(ids, self._params(sampling), constraint)

    def chat(self, messages: list[dict], constraint=None, **sampling) -> Iterator[Chunk]:
        """Stream the assistant's reply to a conversation, using the chat template (constraint:
        as in ``generate``)."""
        return self._generate(self.chat_tokens(messages), self._params(sampling), constraint)

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

    def _generate(self, ids: list[int], params: SamplingParams, constraint=None) -> Iterator[Chunk]:
        if not ids:
            raise EngineError("the prompt is empty")
        if len(ids) >= self.ctx:
            raise EngineError(f"the prompt has {len(ids)} tokens but the context holds {self.ctx}; "
                              "use a larger context size (-c) or a shorter prompt")
        sess = self.session
        cached = sess.reusable(ids)
        sess.truncate(cached)
        stats = GenerationStats()
        self.last_stats = stats
        # Constrained text is checked byte for byte, so it is decoded without space cleaning.
        stream = self.tokenizer.stream(continuation=True, clean_spaces=constraint is None)
        return run_generation(sess.feed, ids, cached, self.ctx - len(ids), params,
                              self.vocab_size, stream, self.tokenizer.is_eog, stats,
                              getattr(self.backend, "logsumexp", None), constraint)

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
        **settings: LoadSettings fields (ctx_size, threads, batch_size, chat_template, ...).
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
