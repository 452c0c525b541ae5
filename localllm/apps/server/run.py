"""`llm serve`: bind first, load the model in the background, serve with uvicorn, and on
SIGTERM/SIGINT end in-flight streams with a final event and exit within a few seconds."""

from __future__ import annotations

import copy
import hashlib
import logging
import socket
import sys
import time
from pathlib import Path

import uvicorn

from localllm import __version__
from localllm.formats.fetch import KNOWN_MODELS, resolve_model_path, resolve_name
from localllm.runtime.process import count_compiles
from ..run_output import CompileLine
from .app import create_app
from .common import ResponseStore, ServerState
from .metrics import Metrics
from .scheduler import Limits, Scheduler
from .security import guarded_protocol
from .settings import ServerSettings


class _Server(uvicorn.Server):
    """uvicorn's server, telling the scheduler first when a signal asks it to stop, so that
    streams end at their next token instead of holding the shutdown."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler):
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig, frame) -> None:
        self.scheduler.shutdown()
        super().handle_exit(sig, frame)


def model_id_for(arg: str | None, path: Path) -> str:
    """The name clients see: the known model's name, else the file's stem."""
    known = resolve_name(arg) if arg else None
    if known is None:
        known = next((m for m in KNOWN_MODELS.values() if m.filename == path.name), None)
    return known.name if known is not None else path.stem


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: a free one): clients that connect
    before the app is up wait in the backlog instead of being refused."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(2048)
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(settings: ServerSettings) -> int:
    """Run the server until a signal stops it.

    Args:
        settings: checked here before anything binds.
    Returns:
        The exit code (0 after a signal).
    Raises:
        ValueError, OSError: unsafe settings, an unknown model, a port in use, or a model
            that failed to load (each a one-line message).
    """
    settings.check()
    from localllm.api import load
    count_compiles()   # /metrics shows the kernels this process compiles
    path = resolve_model_path(settings.model, settings.load.get("models_dir"))
    settings.model_id = settings.model_id or model_id_for(settings.model, path)
    names = frozenset({settings.model_id, path.name, path.stem, *settings.aliases,
                       *([settings.model] if settings.model else [])})
    logging.basicConfig(level=logging.INFO if settings.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    sock = bind(settings.host, settings.port)
    port = sock.getsockname()[1]
    print(f"listening on {_url(settings.host, port)} (model {settings.model_id} loading)",
          file=sys.stderr, flush=True)

    failure: list[str] = []

    def load_model():
        t0 = time.perf_counter()
        load_kw = dict(settings.load)
        if not load_kw.get("kv_pool_mb"):   # room for each slot's full context, memory allowing
            load_kw.setdefault("kv_contexts", max(2, settings.parallel))
        # Kernels this CPU lacks compile now, in parallel workers, grammar ones included:
        # no request waits for the compiler.
        load_kw.setdefault("compile_progress", CompileLine())
        load_kw.setdefault("prime_grammar", True)
        m = load(path, **load_kw)
        fits = max(1, m.plan.pool_tokens // max(1, m.ctx))
        if settings.parallel_default and fits < settings.parallel:
            print(f"--parallel {fits}: the KV cache has room for {fits} full {m.ctx}-token "
                  f"context(s), not {settings.parallel}", file=sys.stderr, flush=True)
            scheduler.limits.parallel = fits
        print(f"model ready: {settings.model_id} (ctx {m.ctx}, {m.plan.summary()}, loaded in "
              f"{time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        return m

    def load_failed(message: str) -> None:
        failure.append(message)
        server.should_exit = True   # polled by uvicorn's main loop

    metrics = Metrics()
    scheduler = Scheduler(load_model, Limits(settings.parallel, settings.max_queue), metrics,
                          load_failed)
    fingerprint = "fp_" + hashlib.sha256(
        f"{__version__}:{path.name}:{path.stat().st_size}".encode()).hexdigest()[:12]
    state = ServerState(settings, scheduler, metrics, ResponseStore(settings.stored_responses),
                        names, fingerprint=fingerprint)
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # logs never on stdout
    config = uvicorn.Config(create_app(state), log_level="info" if settings.verbose else "warning",
                            log_config=log_config, access_log=settings.verbose, lifespan="on",
                            server_header=False, http=guarded_protocol(settings.request_timeout),
                            limit_concurrency=settings.max_connections,
                            timeout_graceful_shutdown=int(max(1, settings.shutdown_grace)))
    server = _Server(config, scheduler)
    scheduler.start()
    server.run(sockets=[sock])
    if failure:
        raise ValueError(f"the model failed to load: {failure[0]}")
    return 0
