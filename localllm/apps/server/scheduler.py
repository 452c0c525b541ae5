"""One worker thread owns the model: it loads it, admits requests from a bounded FIFO queue,
steps every running request together (continuous batching), and hands events back to the
event loop. The kernels release the GIL, so the loop keeps serving while a step runs."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .errors import APIError, busy, request_error
from .metrics import Gauges, Metrics
from localllm.generation.batching import Batcher
from localllm.runtime.process import compiles
from .constraints import Constraints
from .runs import Event, Failed, GenerationSpec, JobRun


@dataclass
class Limits:
    parallel: int = 1       # requests generated together (each with its n choices)
    max_queue: int = 16     # requests waiting beyond those; past that, 503


class Job:
    """One request's place in the scheduler and its stream of events (read on the loop)."""

    def __init__(self, spec: GenerationSpec, loop: asyncio.AbstractEventLoop,
                 scheduler: "Scheduler"):
        self.spec = spec
        self.submitted = time.perf_counter()
        self.cancelled = threading.Event()
        self.run: JobRun | None = None
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._scheduler = scheduler

    def emit(self, events: list[Event]) -> None:
        """Called on the worker thread (one wake-up of the loop for a step's events)."""
        if not events:
            return
        try:
            self._loop.call_soon_threadsafe(self._put, events)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def _put(self, events: list[Event]) -> None:
        for ev in events:
            self._events.put_nowait(ev)

    async def next_event(self) -> Event:
        return await self._events.get()

    def cancel(self) -> None:
        """The client has gone: stop at the next token and forget the request."""
        self._scheduler.cancel(self)


class Passes(Protocol):
    """Work that runs a forward pass at a time (an embedding request's EmbeddingRun)."""

    @property
    def done(self) -> bool: ...

    def next_pass_tokens(self) -> int: ...

    def step(self, limit: int | None = None) -> int: ...


class Work:
    """A request the worker runs one pass per turn, between the generation steps (so a large
    embedding request never stalls the streams in flight); its result settles ``future``."""

    def __init__(self, start: Callable[[Any], Passes], finish: Callable[[Passes], Any],
                 loop: asyncio.AbstractEventLoop, scheduler: "Scheduler"):
        self.start = start            # model -> Passes, on the worker (tokenizing, checks)
        self.finish = finish          # the finished Passes -> the result, on the worker
        self.run: Passes | None = None
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()
        self.cancelled = threading.Event()
        self._scheduler = scheduler

    def cancel(self) -> None:
        """The client has gone: run no further pass."""
        self._scheduler.cancel_work(self)


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _deliver(loop, future: asyncio.Future, value=None, error: BaseException | None = None):
    def settle():
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class Scheduler:
    """The model's only user: load it, then serve generation jobs and short calls in turn."""

    def __init__(self, load: Callable[[], Any], limits: Limits, metrics: Metrics,
                 on_load_failure: Callable[[str], None] | None = None):
        """Args:
            load: builds the model (runs on the worker thread, after the server has bound).
            limits: --parallel and --max-queue.
            metrics: counters the jobs update.
            on_load_failure: called with a one-line message if loading fails.
        """
        self._load = load
        self.limits = limits
        self.metrics = metrics
        self._on_load_failure = on_load_failure
        self.model = None
        self.state = "loading"      # loading | ready | failed | stopping | stopped
        self.error = ""
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []
        self._calls: deque[_Call] = deque()
        self._works: deque[Work] = deque()
        self.batcher: Batcher | None = None
        self.constraints = Constraints()
        self._thread = threading.Thread(target=self._main, name="localllm-worker", daemon=True)

    # ---- the event loop's side ------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def slots(self) -> int:
        return max(1, self.limits.parallel)

    def _refuse_unless_ready(self) -> None:
        if self.state == "loading":
            raise busy("the model is still loading", retry_after=2)
        if self.state != "ready":
            raise APIError(503, "the server is shutting down" if self.state != "failed"
                           else "the model failed to load", "server_unavailable")

    def submit(self, spec: GenerationSpec) -> Job:
        """Queue a generation; it starts when a slot is free, in arrival order.

        Raises:
            APIError: 503 while loading, when stopping, or when the queue is full.
        """
        job = Job(spec, asyncio.get_running_loop(), self)
        with self._cond:
            self._refuse_unless_ready()
            if len(self._active) + len(self._waiting) >= self.slots + self.limits.max_queue:
                self.metrics.rejected()
                raise busy(f"the server is busy: {len(self._waiting)} requests are waiting "
                           f"(--max-queue {self.limits.max_queue})")
            self._waiting.append(job)
            self._cond.notify()
        return job

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(model)`` on the worker between two generation steps, and return its
        result (tokenizing needs the model, which only the worker may touch)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._cond:
            self._refuse_unless_ready()
            self._calls.append(_Call(fn, loop, future))
            self._cond.notify()
        return await future

    def submit_passes(self, start: Callable[[Any], Passes],
                      finish: Callable[[Passes], Any]) -> Work:
        """Queue work that runs a forward pass per turn beside the running generations (the
        oldest such work first); await ``work.future`` for ``finish(passes)``.

        Args:
            start: builds the Passes from the model (on the worker: it may tokenize).
            finish: the result from the Passes once they are done (on the worker).
        Raises:
            APIError: 503 while loading or when stopping.
        """
        work = Work(start, finish, asyncio.get_running_loop(), self)
        with self._cond:
            self._refuse_unless_ready()
            self._works.append(work)
            self._cond.notify()
        return work

    def cancel_work(self, work: Work) -> None:
        """Forget pass-wise work: no pass of it runs after the one running now."""
        with self._cond:
            work.cancelled.set()
            if work in self._works:
                self._works.remove(work)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Forget a waiting job now; a running one stops before the next step."""
        with self._cond:
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
            self._cond.notify()

    def shutdown(self) -> None:
        """Finish in-flight generations at their next token and refuse the rest.
        Safe to call from a signal handler: it only sets state and wakes the worker."""
        if self.state in ("loading", "ready"):
            self.state = "stopping"
        with self._cond:
            self._cond.notify()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def gauges(self, kv=None) -> Gauges:
        """The scheduler's gauges, with the KV cache's blocks when ``kv`` (KVStats) is given."""
        with self._cond:
            g = Gauges(requests_waiting=len(self._waiting), requests_running=len(self._active),
                       model_loaded=int(self.model is not None), kernel_compiles=compiles())
        if kv is not None:
            g.kv_blocks_used, g.kv_blocks_free = kv.blocks_used, kv.blocks_free
            g.kv_blocks_cached = kv.blocks_cached
        return g

    # ---- the worker thread ----------------------------------------------------------

    def _main(self) -> None:
        try:
            model = self._load()
        except Exception as e:  # noqa: BLE001 - any failure is reported in one line
            self.error = (str(e).strip().splitlines() or [type(e).__name__])[0]
            self.state = "failed"
            if self._on_load_failure:
                self._on_load_failure(self.error)
            return
        self.model = model
        self.batcher = Batcher(model)
        with self._cond:
            if self.state == "loading":
                self.state = "ready"
        while self._turn():
            pass
        self.state = "stopped"

    def _turn(self) -> bool:
        """One pass of the worker: short calls, cancellations, admissions, one step of every
        running request together, then one pass of the oldest pass-wise work. Returns False
        once the server is stopping and every request has been ended."""
        with self._cond:
            while not (self._calls or self._waiting or self._active or self._works
                       or self.state == "stopping"):
                self._cond.wait()
            calls, self._calls = list(self._calls), deque()
            stopping = self.state == "stopping"
            waiting, works = [], []
            if stopping:
                waiting, self._waiting = list(self._waiting), deque()
                works, self._works = list(self._works), deque()
            active = list(self._active)
        for c in calls:
            self._run_call(c)
        if stopping:
            for w in works:
                _deliver(w.loop, w.future, error=APIError(503, "the server is shutting down",
                                                          "server_unavailable"))
            for job in active + waiting:
                if job.run is not None and job.run.started:
                    self._end(job)
                else:
                    self._fail(job, APIError(503, "the server is shutting down",
                                             "server_unavailable"))
            return False
        for job in active:
            if job.cancelled.is_set():   # the client left: its blocks go back now
                self._drop(job)
        self._admit()
        self._make_room()
        if self.batcher.active:
            self.batcher.step()
        for job in list(self._active):
            self._advance(job)
        self._work_pass()
        return True

    def _work_pass(self) -> None:
        """One forward pass of the oldest pass-wise work, after the generations' step: it
        takes only KV blocks left free, and beside running generations at most a prompt
        chunk's tokens (one longer input alone), so each stream still gets a token a turn."""
        with self._cond:
            if not self._works:
                return
            work = self._works[0]
        try:
            if work.run is None:
                work.run = work.start(self.model)
            run = work.run
            if not run.done:
                room = self._free_blocks() * self._block_size()
                if self.batcher.active:
                    if run.next_pass_tokens() > room:
                        return  # its next input waits for the generations' blocks
                    room = min(room, self.batcher.token_budget)
                run.step(room)
            if not run.done:
                return
            result = work.finish(run)
        except Exception as e:  # noqa: BLE001 - the request fails, never the worker
            self._end_work(work)
            _deliver(work.loop, work.future, error=request_error(e))
            return
        self._end_work(work)
        _deliver(work.loop, work.future, result)

    def _end_work(self, work: Work) -> None:
        with self._cond:
            if work in self._works:
                self._works.remove(work)

    def _admit(self) -> None:
        """Start waiting requests in arrival order while there are slots, and KV room for
        their prompts (the first always starts when nothing else runs)."""
        while True:
            with self._cond:
                if not self._waiting or len(self._active) >= self.slots:
                    return
                job = self._waiting.popleft()
                self._active.append(job)
            try:
                if job.run is None:
                    job.run = JobRun(self.model, job.spec, self.metrics, job.submitted,
                                     self._constraint(job.spec))
                if len(self._active) > 1 and self._free_blocks() < job.run.blocks_needed(
                        self._block_size()):
                    self._requeue(job)
                    return
                job.emit(job.run.start(self.batcher))
            except Exception as e:  # noqa: BLE001 - the request fails, never the worker
                self._fail(job, request_error(e))

    def _constraint(self, spec):
        return self.constraints.get(self.model, spec.output) if spec.output else None

    def _make_room(self) -> None:
        """Before a step: if its KV blocks might not be free, give the youngest requests'
        back (preemption) until they are, so that a full pool never fails a step."""
        while len(self._active) > 1 and self._free_blocks() < self.batcher.blocks_for_next_step():
            job = self._active[-1]
            job.run.preempt(self.batcher)
            self.metrics.preempted()
            self._requeue(job)

    def _free_blocks(self) -> int:
        return min(g.free for g in self.model.kv_stats().groups)

    def _block_size(self) -> int:
        return self.model.settings.kv_block_size

    def _requeue(self, job: Job) -> None:
        """Back to the head of the queue: it arrived before every request waiting there."""
        with self._cond:
            if job in self._active:
                self._active.remove(job)
            self._waiting.appendleft(job)

    def _run_call(self, c: _Call) -> None:
        try:
            _deliver(c.loop, c.future, c.fn(self.model))
        except Exception as e:  # noqa: BLE001 - the call fails, never the worker
            _deliver(c.loop, c.future, error=request_error(e))

    def _advance(self, job: Job) -> None:
        if not job.run.running:
            return
        try:
            events = job.run.advance(self.batcher)
        except Exception as e:  # noqa: BLE001
            self._fail(job, request_error(e))
            return
        job.emit(events)
        if job.run.done:
            self._remove(job)

    def _end(self, job: Job) -> None:
        """Stop a job's generation now, with final events (cut short by the server)."""
        job.emit(job.run.stop(self.batcher, "length"))
        self._remove(job)

    def _drop(self, job: Job) -> None:
        if job.run is not None:
            job.run.cancel(self.batcher)
        self._remove(job)

    def _fail(self, job: Job, error: APIError) -> None:
        if job.run is not None:
            job.run.cancel(self.batcher)
        job.emit([Failed(error)])
        self._remove(job)

    def _remove(self, job: Job) -> None:
        with self._cond:
            if job in self._active:
                self._active.remove(job)
