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
import sys
import time
from dataclasses import dataclass, fields, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence as Seq

import numpy as np

from localllm.backends.base import Backend
from localllm.errors import (BadSetting, EmptyPrompt, EngineError, LocalLLMError, PromptTooLong,
                             SequenceError, UnsupportedModel)
from localllm.generation.constrain import prime
from localllm.generation.model_embedding import EmbeddingMixin
from localllm.formats import fetch
from localllm.formats.gguf import GGUFFile
from localllm.generation.decoder import (Chunk, Decoder, DecoderHooks, GenerationStats,
                                         run_generation)
from localllm.generation.sampling import SamplingParams
from localllm.generation.speculative import (MAX_DRAFT, LookupDrafter, ModelDrafter, Speculator,
                                             check_vocabularies)
from localllm.models import build, module_for
from localllm.models.common import WeightLoader, check_blocks
from localllm.runtime import warm
from localllm.runtime.placement import (MemoryPlan, PlanRequest, make_gpu_backend, parse_gpu_layers,
                                        plan_memory, resolve_backend, tensor_rules)
from localllm.runtime.process import ProcessConfig, configure_process
from localllm.runtime.sequence import KVSpace, KVStats, Runner, Sequence, StepItem, check_tokens
from localllm.text.chat_template import ChatTemplate
from localllm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from localllm.backends.cpu import CpuBackend

DEFAULT_CTX = 4096
KV_TYPES = ("f16", "bf16", "q8_0", "q4_0", "fp8")
# Default pool: room for this many full contexts (one request's, plus cached prefixes).

__all__ = ["EngineError", "Generation", "KVStats", "LoadSettings", "Model", "ProcessConfig",
           "Sequence", "StepItem", "configure_process", "load"]


@dataclass
class LoadSettings:
    """How to load and run a model."""
    ctx_size: int = 0            # 0: min(4096, the model's training context)
    threads: int = 0             # 0: the number of physical cores
    batch_size: int = 256        # prompt tokens per forward pass
    chat_template: str | None = None   # builtin name or file; None: the file's own
    backend: str = "auto"              # GPU backend: auto, cpu (none), torch or mlx
    gpu_layers: int | str = "auto"     # layers on the GPU backend (the last ones): N, auto, all
    cpu_moe: bool = False              # every layer's experts on the CPU
    n_cpu_moe: int = 0                 # the experts of the first N layers on the CPU
    override_tensor: tuple = ()        # "REGEX=BACKEND" rules (CPU or GPU), as llama.cpp's -ot
    # MB of packed copies of the experts read from the file (most recently used kept);
    # None: half the memory free beyond 1 GiB at the first MoE layer, at most all of them
    expert_cache_mb: float | None = None
    models_dir: str | None = None      # model cache directory override
    download: bool = True              # fetch known model names when not cached
    weight_cache: bool = False         # also keep repacked weights on disk (a second copy)
    ctk: str = "f16"                   # KV cache type of keys ...
    ctv: str = "f16"                   # ... and of values (see KV_TYPES)
    kv_block_size: int = 16            # tokens per KV block (a multiple of 16)
    kv_pool_mb: float = 0              # KV pool limit; 0: kv_contexts contexts, as memory allows
    kv_contexts: int = 2               # full contexts the default KV pool aims to hold
    lookup: int = 0                    # prompt lookup drafts up to this many tokens (0: off)
    draft: str | None = None           # a draft model (path or known name) to speculate with
    draft_max: int = 8                 # the draft model drafts up to this many tokens

    # Build missing compiled kernels in parallel worker processes, reporting (done, total)
    # here (None: compile in-process on first use).
    compile_progress: Callable[[int, int], None] | None = None
    # Also compile the constrained-decoding kernels during the load (with the model's, in
    # the workers when compile_progress is given), not at the first constrained request.
    prime_grammar: bool = False


def _check_speculation(s: LoadSettings) -> None:
    if not 0 <= s.lookup <= MAX_DRAFT:
        raise BadSetting(f"lookup must be in 0..{MAX_DRAFT} drafted tokens, got {s.lookup}",
                         param="lookup")
    if not 1 <= s.draft_max <= MAX_DRAFT:
        raise BadSetting(f"draft_max must be in 1..{MAX_DRAFT} tokens, got {s.draft_max}",
                         param="draft_max")


def _check_kv_types(ctk: str, ctv: str) -> None:
    for name, t in (("ctk", ctk), ("ctv", ctv)):
        if t not in KV_TYPES:
            raise BadSetting(f"unknown KV type {t!r} for {name} (choose from "
                             f"{', '.join(KV_TYPES)})", param=name)


def physical_cores() -> int:
    try:
        import psutil
        n = psutil.cpu_count(logical=False)
    except ImportError:  # pragma: no cover - psutil is a dependency
        n = None
    return n or os.cpu_count() or 1


def _make_cpu_backend(settings: LoadSettings) -> CpuBackend:
    from localllm.backends.cpu import CpuBackend
    cache = fetch.cache_dir(settings.models_dir).parent / "packed" if settings.weight_cache else None
    mb = settings.expert_cache_mb
    return CpuBackend(weight_cache=cache,
                      expert_cache=None if mb is None else int(max(0.0, mb) * 1e6))


def plan_request(settings: LoadSettings, ctx: int) -> PlanRequest:
    """What the memory ledger is planned for, from load settings."""
    rules = tensor_rules(settings.override_tensor, settings.cpu_moe, settings.n_cpu_moe)
    return PlanRequest(ctx, settings.ctk, settings.ctv, settings.kv_block_size,
                       max(1, settings.batch_size), settings.kv_pool_mb, settings.gpu_layers,
                       max(1, settings.kv_contexts), rules)


@dataclass(frozen=True)
class ModelPlan:
    """A model file's plan under its load settings: the memory ledger, the architecture's
    ModelArgs, and the backends it was planned on."""
    memory: MemoryPlan
    args: Any
    cpu: Backend
    gpu: Backend | None


def plan_model(file: GGUFFile, settings: LoadSettings, free: dict | None = None) -> ModelPlan:
    """The memory ledger of a model file under these settings, without loading it.

    Returns:
        the ModelPlan.
    Raises:
        UnsupportedModel: an architecture or metadata this engine cannot run.
        BadSetting: bad settings (``param`` names which).
        NotEnoughMemory: a model that does not fit (naming the numbers).
    """
    meta = file.metadata
    module = module_for(meta)  # an unsupported architecture fails before any other work
    args = module.ModelArgs.from_gguf(meta, meta["general.architecture"])
    check_blocks(file.tensors, args.arch, args.n_layers)  # before sizing the KV cache
    ctx = settings.ctx_size or min(DEFAULT_CTX, args.context_length)
    if ctx <= 0:
        raise BadSetting(f"context size must be positive, got {ctx}", param="ctx_size")
    _check_kv_types(settings.ctk, settings.ctv)
    parse_gpu_layers(settings.gpu_layers)
    cpu = _make_cpu_backend(settings)
    gpu = make_gpu_backend(resolve_backend(settings.backend),
                           settings.threads or physical_cores())
    plan = plan_memory(file.tensors, args, cpu, gpu, plan_request(settings, ctx), free)
    return ModelPlan(plan, args, cpu, gpu)


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

    def close(self) -> None:
        self.decoder.close()
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


class Model(EmbeddingMixin):
    """A loaded model: tokenizer, chat template, placed layers and the paged KV cache
    (embeddings, ranking and fill-in-the-middle prompts: generation/model_embedding.py)."""

    def __init__(self, path: str | os.PathLike, settings: LoadSettings | None = None):
        t0 = time.perf_counter()
        self.settings = s = settings or LoadSettings()
        # Before any kernel runs (this process's threads, allocator and kernel cache).
        configure_process(threads=s.threads or physical_cores())
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        meta = self.file.metadata
        self.metadata = meta
        _check_speculation(s)  # before any work
        planned = plan_model(self.file, s)
        self.plan, args = planned.memory, planned.args
        self.backend, self.gpu_backend = planned.cpu, planned.gpu
        ctx = self.plan.ctx
        placement = self.plan.placement()
        self.backends = placement.backends()
        if s.compile_progress is not None:
            # Kernels missing from the compile cache are built by parallel workers first;
            # until its fused block is built (at low priority, meanwhile) the model runs op
            # by op. Without progress, kernels compile in-process on first use.
            calls = (prime.WARM_JOB,) if s.prime_grammar else ()
            if not warm.prepare(self.path, s.compile_progress, block_command=_BLOCK_WORKER,
                                calls=calls):
                self.backend.fused_blocks = False
        for be in self.backends:
            be.begin_model(self.path)  # may read stored weights while the rest builds
        self.tokenizer = Tokenizer.from_metadata(meta)
        self.template = ChatTemplate.resolve(meta, s.chat_template)
        self.net = build(meta, WeightLoader(self.file, placement), args, ctx)
        for be in self.backends:
            be.end_model()
        self.args = self.net.args
        self.vocab_size = self.args.vocab_size
        self.ctx = ctx
        self._pool_tokens = self.plan.pool_tokens
        self._identity = file_identity(self.path)
        self.kv, self._runner = self._new_cache(s.ctk, s.ctv)
        self.last_stats = GenerationStats()
        self.draft = self._load_draft(s) if s.draft else None
        if s.prime_grammar:
            prime.prime_kernels()  # loaded from the cache the workers filled, or compiled
        self.load_seconds = time.perf_counter() - t0

    def _load_draft(self, s: LoadSettings) -> "Model":
        """The draft model, with the same settings and context; its vocabulary must be the
        target's."""
        path = fetch.resolve_model_path(s.draft, s.models_dir, download=s.download)
        draft = Model(path, replace(s, draft=None, lookup=0, ctx_size=self.ctx))
        try:
            check_vocabularies(self.tokenizer, draft.tokenizer, self.path.name, path.name)
        except BadSetting:
            draft.close()
            raise
        return draft

    # ---- text <-> tokens ------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids: Seq[int], skip_special: bool = False) -> str:
        """The text of token ids.

        Raises:
            TokenOutOfVocab: an id outside the vocabulary (``param`` "ids").
        """
        check_tokens(ids, self.vocab_size, "ids")
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
        except LocalLLMError:
            raise
        except ValueError as e:  # a KV layout a backend cannot hold
            raise BadSetting(str(e)) from None
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

    def prepare(self, seq: Sequence, ids: Seq[int]) -> int:
        """Make ``seq`` ready to run ``ids``: it keeps its longest usable common prefix with
        them, or takes a longer one from the prefix cache.

        Returns:
            How many of ``ids`` need no processing (at most len(ids) - 1).
        """
        return self._runner.reuse(seq, ids)

    def kv_stats(self) -> KVStats:
        """Blocks used, cached and free, and the bytes per token of the KV types."""
        return self.kv.stats()

    def forget_cached(self) -> None:
        """Drop the cached prefixes of finished requests (the next prompts run in full)."""
        self.kv.cache.forget_cached()
        self.kv.recurrent.forget_cached()

    def step(self, items: list[StepItem]) -> list:
        """One forward pass over several sequences' new tokens (continuous batching, a
        speculative verification).

        Args:
            items: StepItem(sequence, tokens, logits "none" | "last" | "all"), each
                sequence at most once.
        Returns:
            Per item: float32 (len(tokens), vocab) for "all", (vocab,) for "last", None for
            "none" (see runtime.sequence.Runner.step).
        """
        return self._runner.step(items)

    # ---- scoring and generation -----------------------------------------------------

    def logits(self, ids: Seq[int]) -> np.ndarray:
        """Teacher-forced logits of every position, computed afresh (no cached prefix).

        Returns:
            float32 (len(ids), vocab_size).
        """
        if len(ids) > self.ctx:
            raise PromptTooLong(f"{len(ids)} tokens exceed the context size {self.ctx}",
                                param="ids", n_tokens=len(ids), ctx=self.ctx)
        with self.new_sequence() as seq:
            return seq.feed(ids, all_logits=True)

    def generate(self, prompt: str | Seq[int], seq: Sequence | None = None, constraint=None,
                 speculate: bool = True, **sampling) -> Generation:
        """Stream a continuation of a prompt (text, tokenized with BOS per the model, or ids).

        Args:
            prompt: text or token ids.
            seq: the sequence to continue (its KV for the common prefix is reused, and it
                holds the prompt and the output afterwards); None: a fresh one, released
                at the end.
            constraint: optional TokenConstraint over ``token_vocab`` (e.g.
                TokenConstraint.json_schema(schema, m.token_vocab)); used up by one call.
            speculate: draft tokens as the load settings say (prompt lookup, a draft
                model); False: plain decoding. The output is the same either way (at a
                temperature above 0, distributed the same).
            **sampling: SamplingParams fields (temperature, top_k, ..., seed, max_tokens, stop).
        Returns:
            A Generation: Chunk pieces of text (str) carrying .tokens, .logprobs and, on the
            last, .finish_reason.
        """
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        return self._generate(ids, self._params(sampling), seq, constraint=constraint,
                              speculate=speculate)

    def chat(self, messages: list[dict], seq: Sequence | None = None,
             context_shift: bool = False, constraint=None, speculate: bool = True,
             tools: list[dict] | None = None, tool_choice=None, parallel_tool_calls: bool = True,
             **sampling) -> Generation:
        """Stream the assistant's reply to a conversation, using the chat template.

        Args:
            messages: [{"role", "content"}, ...] (with tools: OpenAI's assistant
                ``tool_calls`` and ``tool`` messages too).
            seq: as for generate.
            context_shift: when the conversation does not fit, or fills up while replying,
                drop its oldest turns (after any system message) instead of failing or
                stopping; ``stats.dropped_messages`` counts them (not with tools).
            constraint, speculate: as for generate.
            tools: function tools in OpenAI's shape ({"type": "function", "function":
                {"name", "description", "parameters"}}); the reply then yields ToolCall
                objects after its text.
            tool_choice: "auto" (default), "none", "required" or {"type": "function",
                "function": {"name": ...}}; the last two constrain the reply to calls.
            parallel_tool_calls: whether a forced reply may hold several calls.
            **sampling: SamplingParams fields.
        Raises:
            ToolCallError: tools or a tool_choice that cannot be used.
        """
        params = self._params(sampling)
        if tools:
            return self._tool_chat(messages, params, seq, constraint, speculate, tools,
                                   tool_choice, parallel_tool_calls, context_shift)
        if not context_shift:
            return self._generate(self.chat_tokens(messages), params, seq,
                                  constraint=constraint, speculate=speculate)
        return self._shifting_chat(list(messages), params, seq, constraint, speculate)

    def _tool_chat(self, messages, params, seq, constraint, speculate, tools, tool_choice,
                   parallel, context_shift) -> Generation:
        """chat() with tools: the prompt and constraint of their plan, the calls split off."""
        from localllm.generation.tool_stream import stream_calls
        from localllm.generation.tool_use import plan
        if context_shift:
            raise BadSetting("context_shift cannot be combined with tools")
        p = plan(self.template.source, list(messages), {}, tools, tool_choice, parallel)
        if constraint is None:
            constraint = p.constraint(self.token_vocab)
        gen = self._generate(self.chat_tokens(p.messages, **p.template_kwargs), params, seq,
                             constraint=constraint, speculate=speculate)
        return gen if p.fmt is None else Generation(stream_calls(gen, p), gen.stats)

    @cached_property
    def token_vocab(self):
        """The vocabulary as constraints see it (localllm.generation.constrain.TokenVocab), built once."""
        from localllm.generation.constrain import TokenVocab
        return TokenVocab.from_tokenizer(self.tokenizer)

    def _params(self, sampling: dict) -> SamplingParams:
        names = {f.name for f in fields(SamplingParams)}
        unknown = set(sampling) - names
        if unknown:
            raise TypeError(f"unknown sampling settings: {', '.join(sorted(unknown))}")
        p = SamplingParams(**sampling)
        p.validate()
        return p

    def check_prompt(self, ids: Seq[int], param: str = "prompt") -> None:
        """What every generation checks of its prompt first, for callers that check many
        prompts before starting any (the server does).

        Args:
            ids: the prompt's token ids.
            param: the argument or request field the prompt came from, for ``.param``.
        Raises:
            EmptyPrompt: no tokens.
            TokenOutOfVocab: an id outside the vocabulary.
            PromptTooLong: no room left in the context for a reply.
        """
        if not self.net.generates:
            raise UnsupportedModel(f"{self.args.arch} is an embedding model; it does not "
                                   "generate text", param="model")
        if not ids:
            raise EmptyPrompt("the prompt is empty", param=param)
        check_tokens(ids, self.vocab_size, param)
        if len(ids) >= self.ctx:
            raise PromptTooLong(f"the prompt has {len(ids)} tokens but the context holds "
                                f"{self.ctx}; use a larger context size (-c) or a shorter prompt",
                                param=param, n_tokens=len(ids), ctx=self.ctx)

    def _generate(self, ids: list[int], params: SamplingParams, seq: Sequence | None,
                  shift=None, stats: GenerationStats | None = None,
                  constraint=None, speculate: bool = True) -> Generation:
        self.check_prompt(ids)
        if seq is not None:
            seq._check()
        stats = stats or GenerationStats()
        self.last_stats = stats
        return Generation(self._run(ids, params, seq, stats, shift, constraint, speculate),
                          stats)

    def _run(self, ids, params, seq, stats, shift, constraint, speculate) -> Iterator[Chunk]:
        d = self._start(ids, params, seq, stats, shift, constraint, speculate)
        try:
            yield from run_generation(d.seq.feed, d.decoder)
        finally:
            d.close()

    def start(self, prompt: str | Seq[int], seq: Sequence | None = None, constraint=None,
              speculate: bool = True, **sampling) -> "Decoding":
        """A generation to drive step by step (batching.Batcher does): the prompt is matched
        against the cache now; see generate for the arguments."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.check_prompt(ids)
        stats = GenerationStats()
        self.last_stats = stats
        return self._start(ids, self._params(sampling), seq, stats, None, constraint, speculate)

    def _start(self, ids, params, seq, stats, shift, constraint,
               speculate: bool = True) -> "Decoding":
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

        def rollback(n: int) -> None:
            want = len(seq) - n
            tokens = seq.tokens[:want]
            kept = seq.trim(want)
            if kept != want and seq.rec is not None:
                seq.feed(tokens[kept:])  # recurrent states resume from their last snapshot
            elif kept != want:  # cannot happen for a draft within one KV block
                raise SequenceError(f"could not roll a sequence back to {want} tokens")

        # Constrained text is checked byte for byte: decoded without space cleaning.
        stream = self.tokenizer.stream(continuation=True, clean_spaces=constraint is None)
        hooks = DecoderHooks(after_prompt=lambda: self._runner.checkpoint(seq),
                             shift=make_room if shift is not None else None,
                             speculate=self._speculator(params, seq) if speculate else None,
                             rollback=rollback)
        decoder = Decoder(ids, cached, self.ctx - len(ids), params,
                          vocab_size=self.vocab_size, stream=stream,
                          is_eog=self.tokenizer.is_eog, stats=stats,
                          logsumexp=self.backend.logsumexp, constraint=constraint, hooks=hooks)
        return Decoding(decoder, seq, own)

    def _speculator(self, params: SamplingParams, seq: Sequence):
        """Returns: what makes a generation's Speculator (given its seed), or None when
        the load settings ask for no drafts."""
        s = self.settings
        if not s.lookup and self.draft is None:
            return None

        def make(seed: int) -> Speculator:
            drafters = [LookupDrafter(s.lookup)] if s.lookup else []
            if self.draft is not None:
                drafters.append(ModelDrafter(self.draft, lambda: seq.tokens, params, seed,
                                             s.draft_max, self.vocab_size,
                                             self.tokenizer.is_eog))
            return Speculator(drafters)
        return make

    def _shifting_chat(self, messages: list[dict], params: SamplingParams,
                       seq: Sequence | None, constraint=None,
                       speculate: bool = True) -> Generation:
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
            raise PromptTooLong("the last message alone does not fit in the context; use a "
                                "larger context size (-c)", param="messages", ctx=self.ctx)

        def shift(generated: list[int]):
            before = dropped
            new = fit(list(generated))
            if new is None or dropped == before:
                return None
            return new, self.ctx - len(new)

        return self._generate(ids, params, seq, shift, stats, constraint, speculate)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# The worker that compiles one model's fused block: it loads the model (runtime/warm.py
# builds every other kernel group below the API, but a block is compiled by its own load).
_BLOCK_WORKER = [sys.executable, "-c",
                 "import sys; from localllm.api import compile_block; sys.exit(compile_block(sys.argv[1]))"]


def compile_block(path: str) -> int:
    """Worker entry: load a model and score two tokens, which compiles exactly the fused
    blocks its later runs take; marks the block built in the kernel cache (runtime/warm.py).

    Returns:
        The process exit status (0: built).
    """
    configure_process(threads=1)

    def score():
        m = load(path, threads=1, ctx_size=64)
        m.logits([0, 1])
        m.close()
    return warm.main_for(warm.block_job(path), score)


def load(path_or_name: str | os.PathLike | None = None, **settings) -> Model:
    """Load a GGUF model by path or known name (fetched and cached on first use). The process
    is configured first (``configure_process``: kernel threads, allocator, kernel cache).

    Args:
        path_or_name: a .gguf path, a known model name (see ``llm list``), or None for the
            default model.
        **settings: LoadSettings fields (ctx_size, threads, batch_size, chat_template, ctk,
            ctv, kv_block_size, kv_pool_mb, lookup, draft, draft_max, ...).
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
