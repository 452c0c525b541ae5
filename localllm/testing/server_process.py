"""A real `llm serve` process on 127.0.0.1 (a free port) for tests and benchmarks."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

LISTENING = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    """`llm serve MODEL --port 0 ARGS...`, its URL read from the line it prints on start."""

    def __init__(self, model: str, *args: str, api_key: str | None = None,
                 env: dict[str, str] | None = None):
        """Args:
            model: the model argument of `llm serve`.
            *args: more arguments of `llm serve`.
            api_key: the server's --api-key (and the key ``headers`` sends).
            env: variables to set in the server's environment, over this process's.
        """
        cmd = [sys.executable, "-m", "localllm.apps.cli", "serve", str(model), "--port", "0", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.api_key = api_key
        env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(120):
            self.stop()
            raise RuntimeError("the server did not start: " + "".join(self.lines))
        if not self.url:
            raise RuntimeError("the server exited: " + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = LISTENING.search(line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120, **kw)

    def wait_ready(self, timeout: float = 300) -> list[int]:
        """Poll /health until 200; returns the statuses seen on the way."""
        seen = []
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError("the server exited: " + "".join(self.lines))
                r = c.get("/health")
                seen.append(r.status_code)
                if r.status_code == 200:
                    return seen
                time.sleep(0.05)
        raise RuntimeError("the model did not load in time")

    def metrics(self) -> dict[str, float]:
        """The /metrics samples by name (labels kept in the name)."""
        with self.client() as c:
            text = c.get("/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
