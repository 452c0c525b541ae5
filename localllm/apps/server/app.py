"""The ASGI app: the OpenAI-compatible routes, health, metrics and tokenizing, behind the
Host allowlist, the API key check and the body limit (and CORS when asked for)."""

from __future__ import annotations

import os

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.routing import Match
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse

from localllm import __version__
from localllm.errors import TokenOutOfVocab
from . import anthropic_api, embeddings_api, openai_api, responses_api
from .common import ServerState
from .errors import APIError, api_error, error_body, install_handlers
from .schemas import DetokenizeRequest, TokenizeRequest
from .security import GuardMiddleware, HostAllowlist


def create_app(state: ServerState) -> FastAPI:
    """Build the app around a server state whose scheduler is (or will be) running.

    Args:
        state: settings, scheduler, metrics and the response store.
    Returns:
        The ASGI app, ready for uvicorn.
    """
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.scheduler.shutdown()
        state.scheduler.join(timeout=state.settings.shutdown_grace)

    # No /docs or /redoc: those pages load scripts from a CDN; the schema itself is served.
    app = FastAPI(title="localllm", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", lifespan=lifespan,
                  description="A local OpenAI-compatible endpoint.")
    app.state.server = state
    app.add_middleware(V1Aliases)
    install_handlers(app)
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(embeddings_api.router)
    app.include_router(anthropic_api.router)
    _add_service_routes(app)
    s = state.settings
    hosts = HostAllowlist([*s.allow_hosts, s.host])
    app.add_middleware(GuardMiddleware, hosts=hosts, api_key=s.api_key, max_body=s.max_body,
                       body_timeout=s.request_timeout)
    if s.cors_origins:  # off unless asked for: a web page must not reach the model by default
        app.add_middleware(CORSMiddleware, allow_origins=s.cors_origins,
                           allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key",
                                          "anthropic-version", "anthropic-beta"])
    return app


def _add_service_routes(app: FastAPI) -> None:
    def st(request: Request) -> ServerState:
        return request.app.state.server

    @app.get("/health")
    async def health(request: Request):
        """200 once the model is loaded; 503 while it loads (or if it failed)."""
        sched = st(request).scheduler
        if sched.state == "ready":
            return JSONResponse({"status": "ok"})
        message = {"loading": "the model is still loading",
                   "failed": f"the model failed to load: {sched.error}"}.get(
            sched.state, "the server is shutting down")
        return JSONResponse({"status": sched.state, **error_body(503, message, sched.state)},
                            status_code=503, headers={"Retry-After": "2"})

    @app.get("/v1/models")
    async def list_models(request: Request):
        s = st(request)
        return JSONResponse({"object": "list",
                             "data": [_model_card(s, n) for n in s.listed_names()]})

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str, request: Request):
        s = st(request)
        s.check_model(model_id)
        return JSONResponse(_model_card(s, model_id))

    @app.get("/v1/props")
    async def props(request: Request):
        """The server's properties as llama-server's /props gives them, for clients that
        read it: the model, its context size and chat template, modalities and slots."""
        s = st(request)
        ctx, template = await s.scheduler.call(
            lambda m: (m.ctx, m.template.source))
        return JSONResponse({"model_alias": s.model_id, "model_path": os.path.basename(s.settings.model or ""),
                             "n_ctx": ctx, "chat_template": template,
                             "modalities": {"vision": False, "audio": False},
                             "total_slots": s.scheduler.slots,
                             "default_generation_settings": {"n_ctx": ctx,
                                                             "params": s.settings.sampling},
                             "build_info": f"localllm {__version__}"})

    @app.get("/metrics")
    async def metrics(request: Request):
        s = st(request)
        kv = None
        if s.scheduler.state == "ready":
            try:   # read on the worker, which alone touches the model
                kv = await s.scheduler.call(lambda m: m.kv_stats())
            except APIError:   # stopping meanwhile
                pass
        text = s.metrics.render(s.scheduler.gauges(kv))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        """Token ids of a text, or of a conversation as the chat endpoint renders it."""
        s = st(request)
        s.check_model(body.model)
        if body.messages is not None:
            messages = [m.as_template_message() for m in body.messages]
            ids, ctx = await s.scheduler.call(lambda m: (m.chat_tokens(messages), m.ctx))
        else:
            text, special = body.content, body.add_special
            ids, ctx = await s.scheduler.call(
                lambda m: (m.tokenize(text, add_special=special), m.ctx))
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": ctx})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        s = st(request)
        s.check_model(body.model)
        ids = list(body.tokens)

        def run(m):
            try:
                return m.detokenize(ids)
            except TokenOutOfVocab as e:
                raise api_error(e, "tokens") from None
        return JSONResponse({"content": await s.scheduler.call(run)})


def _model_card(s: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": s.created, "owned_by": "localllm"}


class V1Aliases:
    """Serves /chat/completions, /models, /responses, /props, ... as /v1/...: a path no route
    has is tried with the /v1 prefix (clients that leave it out, as llama-server allows,
    reach the same routes)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not scope["path"].startswith("/v1/"):
            routes = scope["app"].router.routes
            if not _routed(routes, scope) and _routed(routes, v1 := dict(
                    scope, path="/v1" + scope["path"])):
                scope = dict(v1, raw_path=b"/v1" + scope.get("raw_path", b""))
        await self.app(scope, receive, send)


def _routed(routes, scope) -> bool:
    """Whether some route has the scope's path (for any method)."""
    return any(r.matches(scope)[0] != Match.NONE for r in routes)
