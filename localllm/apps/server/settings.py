"""What `llm serve` was asked for, checked once before anything binds or loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from .security import is_loopback

DEFAULT_PORT = 8080
DEFAULT_MAX_BODY = 4 << 20


@dataclass
class ServerSettings:
    """Args:
        model: a GGUF path or known model name (None: the default model).
        model_id: the name clients see in /v1/models and send as ``model``.
        host, port: where to listen (port 0: any free port, printed on start).
        api_key: the bearer token requests must carry (None: none needed, loopback only).
        allow_hosts: Host header values accepted besides loopback names and addresses.
        cors_origins: browser origins allowed to call the API (none: CORS off).
        parallel: requests generated together; max_queue: requests waiting beyond them.
        parallel_default: parallel was not given: fewer slots when the KV cache cannot hold
            a full context for each (said on stderr).
        max_body: largest request body in bytes; max_n: most choices a request may ask for.
        max_connections: open connections at most (more get 503 at once).
        request_timeout: seconds a client has to send a request's head, and at most between
            two parts of its body (slow clients are cut off, not waited for).
        stored_responses: Responses API results kept for ``previous_response_id``.
        load: keyword arguments of ``localllm.load`` (context size, threads, KV types...).
        sampling: the default SamplingParams fields, for what a request leaves out.
        shutdown_grace: seconds in-flight streams get to end after SIGTERM/SIGINT.
        reasoning_format: "none" leaves a model's reasoning in the content; "deepseek" and
            "auto" return it apart (``reasoning_content``, thinking blocks).
        verbose: log each request.
        aliases: more names /v1/models lists for the model (--alias).
        strict_model: refuse (404) requests naming another model; otherwise any name is
            served by this one.
    """
    model: str | None = None
    model_id: str = ""
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    allow_hosts: list[str] = field(default_factory=list)
    cors_origins: list[str] = field(default_factory=list)
    parallel: int = 4
    parallel_default: bool = False
    max_queue: int = 16
    max_body: int = DEFAULT_MAX_BODY
    max_n: int = 8
    max_connections: int = 256
    request_timeout: float = 10.0
    stored_responses: int = 256
    load: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    shutdown_grace: float = 3.0
    reasoning_format: str = "auto"
    verbose: bool = False
    aliases: list[str] = field(default_factory=list)
    strict_model: bool = False

    def check(self) -> None:
        """Raise ValueError, in one line, for settings that are unsafe or make no sense."""
        if not is_loopback(self.host) and not self.api_key:
            raise ValueError(f"refusing to listen on {self.host} without an API key: anyone on "
                             "the network could use the model; give --api-key or --api-key-file "
                             "(or listen on 127.0.0.1)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.parallel < 1:
            raise ValueError(f"--parallel must be >= 1, got {self.parallel}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if self.max_body < 1024:
            raise ValueError(f"--max-body must be at least 1 KB, got {self.max_body} bytes")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        if not 0.1 <= self.request_timeout <= 3600:
            raise ValueError(f"--request-timeout must be in 0.1..3600 seconds, "
                             f"got {self.request_timeout:g}")
        if self.api_key is not None and (not self.api_key.strip() or len(self.api_key) > 4096):
            raise ValueError("the API key is empty or longer than 4096 characters")
        if self.reasoning_format not in ("none", "deepseek", "auto"):
            raise ValueError(f"--reasoning-format must be none, deepseek or auto, "
                             f"got {self.reasoning_format!r}")
        for origin in self.cors_origins:
            if origin != "*" and "://" not in origin:
                raise ValueError(f"--cors-origin wants an origin such as http://localhost:3000, "
                                 f"got {origin!r}")


def read_api_key(path: str) -> str:
    """The API key stored in a file (its first line, without surrounding whitespace)."""
    with open(path, encoding="utf-8") as f:
        key = f.readline().strip()
    if not key:
        raise ValueError(f"the API key file {path} is empty")
    return key
