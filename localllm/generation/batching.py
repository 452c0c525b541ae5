"""Continuous batching: many generations on one model share each forward pass. A request joins
at the next step and leaves as soon as it is done; prompts go in chunks beside the decode
tokens of the others, so a long prompt never stalls the streams already running. Batching
never changes a token: every kernel is batch-invariant.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from localllm.runtime.sequence import StepItem

from .decoder import GenerationStats


@dataclass
class Request:
    """One generation in a Batcher: its output arrives in ``chunks`` as steps run."""
    decoding: object                  # api.Decoding: decoder, sequence, ownership
    chunks: deque = field(default_factory=deque)
    done: bool = False
    error: Exception | None = None
    prompted: bool = False            # the whole prompt has run: it decodes from now on
    _ran: int = 0                     # prompt tokens of the pending ones already run

    @property
    def stats(self) -> GenerationStats:
        return self.decoding.decoder.stats


class Batcher:
    """Steps every active generation of one model together.

    Not thread-safe: one worker thread calls ``add``, ``cancel`` and ``step``.
    """

    def __init__(self, model, token_budget: int | None = None):
        """Args:
            model: an engine.Model.
            token_budget: tokens per forward pass at most (decode tokens first, the rest for
                prompt chunks); default the model's batch size.
        """
        self.model = model
        self.token_budget = max(1, token_budget or model.settings.batch_size)
        self.active: list[Request] = []

    def add(self, prompt: list[int], seq=None, constraint=None, **sampling) -> Request:
        """Start a generation (same arguments as Model.generate with token ids); its prompt
        runs from the next step on.

        Raises:
            EngineError, ValueError, TypeError: as Model.generate would.
        """
        req = Request(self.model.start(prompt, seq=seq, constraint=constraint, **sampling))
        self.active.append(req)
        return req

    def cancel(self, req: Request) -> None:
        """Stop a generation now; its sequence goes back as Model.generate's would."""
        if not req.done:
            req.done = True
            req.decoding.close()
        if req in self.active:
            self.active.remove(req)

    def blocks_for_next_step(self) -> int:
        """Most KV blocks (per cache group) the next step can take: one per decoding
        request, and the prompt chunks' within the token budget (with a partly filled
        block each). A scheduler frees this many before stepping, so a step never finds the
        pool full.

        Returns:
            A block count, 0 when nothing is active.
        """
        bs = self.model.settings.kv_block_size
        decoding = sum(1 for r in self.active if r.prompted)
        prompts = [self.pending_tokens(r) for r in self.active if not r.prompted]
        chunk = min(sum(prompts), max(0, self.token_budget - decoding))
        return decoding + -(-chunk // bs) + len(prompts)

    def pending_tokens(self, req: Request) -> int:
        """Tokens a request has waiting to run.

        Args:
            req: one of this batcher's requests.
        Returns:
            The uncached prompt's length until it has been processed (chunks already run
            included), then 1 for the next token, plus any drafted ones.
        """
        return len(req.decoding.decoder.pending)

    def step(self) -> list[Request]:
        """One forward pass: a decode token of every generating request, and prompt chunks
        in arrival order with what is left of the budget.

        Returns:
            The requests that got new chunks or finished in this step.
        """
        items, reqs = [], []
        budget = self.token_budget
        decoding = [r for r in self.active if r.prompted]
        prefill = [r for r in self.active if not r.prompted]
        for r in decoding:  # a drafted run wants every position's logits, to verify
            d = r.decoding.decoder
            items.append(StepItem(r.decoding.seq, d.pending, "all" if d.all_logits else "last"))
            reqs.append(r)
            budget -= len(d.pending)
        for r in prefill:
            if budget <= 0:
                break
            todo = r.decoding.decoder.pending[r._ran:]
            chunk = todo[:budget]
            last = len(chunk) == len(todo)
            items.append(StepItem(r.decoding.seq, chunk, "last" if last else "none"))
            reqs.append(r)
            budget -= len(chunk)
        if not items:
            return []
        try:
            outs = self.model.step(items)
        except Exception as e:  # a bad step fails its requests, never the worker
            for r in reqs:
                self._fail(r, e)
            return reqs
        touched = []
        for r, it, logits in zip(reqs, items, outs):
            if it.logits == "none":
                r._ran += len(it.tokens)
                continue
            r._ran = 0
            r.prompted = True
            try:
                new = r.decoding.decoder.push(logits)
            except Exception as e:
                self._fail(r, e)
                touched.append(r)
                continue
            r.chunks.extend(new)
            if r.decoding.decoder.done:
                r.done = True
                r.decoding.close()
                self.active.remove(r)
            touched.append(r)
        return touched

    def _fail(self, r: Request, e: Exception) -> None:
        r.error = e
        r.done = True
        r.decoding.close()
        if r in self.active:
            self.active.remove(r)

    def __len__(self) -> int:
        return len(self.active)
