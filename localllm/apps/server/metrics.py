"""Server metrics in the Prometheus text format: latency histograms, token counters, the
prefix cache's hits, KV blocks, queue depth and speculative acceptance."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

PREFIX = "localllm_"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class Histogram:
    """Cumulative buckets, a sum and a count, as Prometheus expects."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, total = [], 0
        for le, n in zip((*map(_num, self.buckets), "+Inf"), self.counts):
            total += n
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        out.append(f"{name}_sum {_num(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


@dataclass
class Gauges:
    """Values read at scrape time from the scheduler and the engine."""
    requests_waiting: int = 0
    requests_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    model_loaded: int = 0
    kernel_compiles: int = 0


@dataclass
class RequestRecord:
    """What one finished generation adds to the counters."""
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    time_to_first_token: float | None = None
    time_per_output_token: float | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_passes: int = 0            # the model's forward passes after the prompt's
    plain_seconds_per_pass: float = 0.0   # measured on passes without a draft (0: none)
    decode_seconds: float = 0.0


@dataclass
class Metrics:
    """Counters and histograms, updated from the worker thread and read by the scraper."""
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0
    generations: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_tokens: int = 0        # generated tokens after each generation's first
    decode_passes: int = 0
    plain_equivalent_seconds: float = 0.0   # what the timed generations' decoding would
    timed_decode_seconds: float = 0.0       # take without drafts, and what it took
    rejected_requests: int = 0
    preempted_requests: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, r: RequestRecord) -> None:
        with self._lock:
            self.generations += 1
            self.prompt_tokens += r.prompt_tokens
            self.cached_tokens += r.cached_tokens
            self.generated_tokens += r.generated_tokens
            self.draft_tokens += r.draft_tokens
            self.accepted_tokens += r.accepted_tokens
            self.decode_tokens += max(r.generated_tokens - 1, 0)
            self.decode_passes += r.decode_passes
            if r.plain_seconds_per_pass > 0 and r.decode_seconds > 0:
                self.plain_equivalent_seconds += (max(r.generated_tokens - 1, 0)
                                                  * r.plain_seconds_per_pass)
                self.timed_decode_seconds += r.decode_seconds
            if r.time_to_first_token is not None:
                self.ttft.observe(r.time_to_first_token)
            if r.time_per_output_token is not None:
                self.tpot.observe(r.time_per_output_token)

    def rejected(self) -> None:
        with self._lock:
            self.rejected_requests += 1

    def preempted(self) -> None:
        with self._lock:
            self.preempted_requests += 1

    def render(self, g: Gauges) -> str:
        """The exposition text for one scrape."""
        with self._lock:
            acceptance = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            per_pass = self.decode_tokens / self.decode_passes if self.decode_passes else 0.0
            speedup = (self.plain_equivalent_seconds / self.timed_decode_seconds
                       if self.timed_decode_seconds else 0.0)
            rows = [
                ("time_to_first_token_seconds", "histogram",
                 "Time from a request's arrival to its first generated token.", self.ttft),
                ("time_per_output_token_seconds", "histogram",
                 "Mean time between generated tokens, one observation per generation.", self.tpot),
                ("prompt_tokens_total", "counter", "Prompt tokens of finished generations.",
                 self.prompt_tokens),
                ("generation_tokens_total", "counter", "Generated tokens.", self.generated_tokens),
                ("prefix_cache_hit_tokens_total", "counter",
                 "Prompt tokens whose KV was reused from the prefix cache.", self.cached_tokens),
                ("generations_total", "counter",
                 "Finished or stopped generations (one per choice).", self.generations),
                ("requests_rejected_total", "counter", "Requests refused with 503 (queue full).",
                 self.rejected_requests),
                ("requests_preempted_total", "counter",
                 "Running requests that gave their KV blocks back to older ones (rerun later).",
                 self.preempted_requests),
                ("spec_decode_draft_tokens_total", "counter", "Tokens proposed by speculation.",
                 self.draft_tokens),
                ("spec_decode_accepted_tokens_total", "counter", "Proposed tokens accepted.",
                 self.accepted_tokens),
                ("spec_decode_acceptance_ratio", "gauge", "Accepted over proposed tokens.",
                 acceptance),
                ("spec_decode_target_passes_total", "counter",
                 "Forward passes of the model after each prompt's.", self.decode_passes),
                ("spec_decode_tokens_per_pass", "gauge",
                 "Generated tokens (after each generation's first) per forward pass.", per_pass),
                ("spec_decode_speedup", "gauge",
                 "Decode speed over plain decoding's, timed on passes without a draft.",
                 speedup),
                ("requests_waiting", "gauge", "Requests in the queue.", g.requests_waiting),
                ("requests_running", "gauge", "Requests being generated.", g.requests_running),
                ("kv_blocks_used", "gauge", "KV cache blocks held by sequences.", g.kv_blocks_used),
                ("kv_blocks_free", "gauge", "KV cache blocks free (cached ones included).",
                 g.kv_blocks_free),
                ("kv_blocks_cached", "gauge", "Free KV blocks still holding a cached prefix.",
                 g.kv_blocks_cached),
                ("model_loaded", "gauge", "1 once the model is loaded.", g.model_loaded),
                ("kernel_compiles_total", "counter",
                 "Kernels this process compiled rather than loaded from the kernel cache "
                 "(during the load; one while serving delays the request it serves).",
                 g.kernel_compiles),
            ]
            out = []
            for name, kind, help_text, value in rows:
                full = PREFIX + name
                out += [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
                if isinstance(value, Histogram):
                    out += value.lines(full)
                else:
                    out.append(f"{full} {_num(value)}")
        return "\n".join(out) + "\n"
