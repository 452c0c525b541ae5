"""POST /v1/embeddings (OpenAI's shape), /v1/rerank and /rerank (scores from a reranker's
classification head), and /infill (llama-server's fill-in-the-middle fields)."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from fastapi import APIRouter, Request
from pydantic import Field, field_validator
from starlette.responses import JSONResponse, Response

from localllm.text.fim import ExtraFile

from .common import (DISCONNECT_POLL_S, ServerState, event_stream, new_id, respond, sse,
                     total_usage, usage_body)
from .errors import APIError
from .runs import Event, Finished, GenerationSpec, Piece, Prompt
from .schemas import ChatFields, _Body

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


# ----------------------------------------------------------------------------- bodies

class EmbeddingRequest(_Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = Field(None, ge=1)

    @field_validator("encoding_format")
    @classmethod
    def _format(cls, v):
        if v not in ("float", "base64"):
            raise ValueError("encoding_format must be 'float' or 'base64'")
        return v

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("input must not be empty")
        if isinstance(v, list) and any(isinstance(x, list) and not x for x in v):
            raise ValueError("input must not hold an empty token list")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list of texts or token-id lists."""
        v = self.input
        if isinstance(v, str):
            return [v]
        if all(isinstance(x, int) for x in v):
            return [list(v)]
        return list(v)


class RerankRequest(_Body):
    query: str
    documents: list[str] = Field(min_length=1)
    model: str | None = None
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False


class InfillExtra(_Body):
    text: str
    filename: str = "tmp"


class InfillRequest(ChatFields):
    input_prefix: str | list[str | int]
    input_suffix: str | list[str | int]
    input_extra: list[InfillExtra] = []
    prompt: str = ""
    n_predict: int | None = Field(None, ge=-1)


# ----------------------------------------------------------------------------- embeddings

def _dimensions(vectors: list[np.ndarray], want: int | None, dim: int) -> list[np.ndarray]:
    """Vectors cut to ``want`` dimensions and renormalised (Matryoshka embeddings)."""
    if want is None or want == dim:
        return vectors
    if want > dim:
        raise APIError(400, f"dimensions: this model's embeddings have {dim} dimensions, "
                            f"fewer than {want}", "invalid_value", "dimensions")
    out = []
    for v in vectors:
        cut = v[:want].astype(np.float64)
        n = np.sqrt((cut ** 2).sum())
        out.append((cut / (n if n > 0 else 1.0)).astype(np.float32))
    return out


def _encode(v: np.ndarray, fmt: str):
    if fmt == "base64":  # little-endian float32, as OpenAI's clients decode it
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


@router.post("/v1/embeddings")
@router.post("/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    """Embeddings of texts or token ids, pooled as the model's file says and L2-normalised."""
    st = _state(request)
    st.check_model(body.model)
    inputs = body.inputs()

    facts: dict = {}

    def start(m):
        if m.pooling == "rank":
            raise APIError(400, "this model is a reranker: use /v1/rerank", "invalid_value",
                           "model")
        facts.update(dim=m.args.dim, matryoshka=_matryoshka(m))
        return m.start_embed(inputs)

    # A pass per scheduler turn, between the decode steps of the streams in flight.
    done = await _passes(st, request, start, lambda run: (run.inputs, run.vectors))
    if done is None:
        return Response(status_code=499)   # the client left; its passes stopped
    ids, vectors = done
    dim, matryoshka = facts["dim"], facts["matryoshka"]
    if body.dimensions is not None and body.dimensions != dim and not matryoshka:
        raise APIError(400, f"dimensions: this model's embeddings have {dim} dimensions and "
                            "cannot be shortened (it is not a Matryoshka model)",
                       "invalid_value", "dimensions")
    vectors = _dimensions(vectors, body.dimensions, dim)
    n = sum(len(x) for x in ids)
    return JSONResponse({
        "object": "list", "model": st.model_id,
        "data": [{"object": "embedding", "index": i, "embedding": _encode(v, body.encoding_format)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n, "total_tokens": n}})


async def _passes(st: ServerState, request: Request, start, finish):
    """``finish(passes)`` of work the scheduler runs a pass per turn, or None (and no
    further pass run) if the client disconnects first.

    Raises:
        APIError: the work failed, or the server cannot take it.
    """
    work = st.scheduler.submit_passes(start, finish)
    try:
        while True:
            done, _ = await asyncio.wait({work.future}, timeout=DISCONNECT_POLL_S)
            if done:
                return work.future.result()
            if await request.is_disconnected():
                work.cancel()
                return None
    except asyncio.CancelledError:
        work.cancel()
        raise


def _matryoshka(m) -> bool:
    """Whether the model's embeddings may be cut short: its file lists Matryoshka
    dimensions ({arch}.embedding.matryoshka_dims, or a name that says so)."""
    meta = m.metadata
    if f"{m.args.arch}.embedding.matryoshka_dims" in meta:
        return True
    text = " ".join(str(meta.get(k, "")) for k in ("general.name", "general.tags",
                                                    "general.basename")).lower()
    return "matryoshka" in text


# ----------------------------------------------------------------------------- rerank

@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request):
    """Documents scored against a query by a reranker (pooling_type rank), best first."""
    st = _state(request)
    st.check_model(body.model)
    query, docs = body.query, body.documents

    done = await _passes(st, request, lambda m: m.start_rerank(query, docs),
                         lambda run: (run.inputs, [float(v[0]) for v in run.vectors]))
    if done is None:
        return Response(status_code=499)
    pairs, scores = done
    order = sorted(range(len(docs)), key=lambda i: -scores[i])[:body.top_n or len(docs)]
    results = []
    for i in order:
        r = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            r["document"] = {"text": docs[i]}
        results.append(r)
    n = sum(len(p) for p in pairs)
    return JSONResponse({"id": new_id("rerank-"), "model": st.model_id, "object": "list",
                         "results": results,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


# ----------------------------------------------------------------------------- infill

@router.post("/infill")
async def infill(body: InfillRequest, request: Request):
    """Fill in the middle between input_prefix and input_suffix, with input_extra files as
    repo-level context, in llama-server's token order; answered as /completion does."""
    st = _state(request)
    st.check_model(body.model)
    max_tokens = body.max_tokens if body.max_tokens is not None else (
        body.n_predict if body.n_predict not in (None, -1) else None)
    extra = [ExtraFile(e.filename, e.text) for e in body.input_extra]
    n_predict = max_tokens if max_tokens is not None else -1
    ids = await st.scheduler.call(lambda m: m.infill_tokens(
        body.input_prefix, body.input_suffix, extra, body.prompt, n_predict))
    sampling = st.sampling(body, max_tokens, body.stop)
    job = st.scheduler.submit(GenerationSpec([Prompt(ids=ids, param="input_prefix")], sampling))
    head = {"id": new_id("cmpl-"), "model": st.model_id, "created": int(time.time())}

    def whole(events: list[Event]) -> JSONResponse:
        text = "".join(ev.text for ev in events if isinstance(ev, Piece))
        finish = next((ev.finish_reason for ev in events if isinstance(ev, Finished)), "length")
        u = usage_body(total_usage(events, 1))
        return JSONResponse({**head, "content": text, "stop": True, "tokens_evaluated": len(ids),
                             "stop_type": "limit" if finish == "length" else "eos",
                             "finish_reason": finish, "usage": u})

    def stream(first: Event):
        def render(ev: Event) -> list[str]:
            if isinstance(ev, Piece) and ev.text:
                return [sse({**head, "content": ev.text, "stop": False})]
            if isinstance(ev, Finished):
                return [sse({**head, "content": "", "stop": True,
                             "finish_reason": ev.finish_reason})]
            return []
        return event_stream(first, job, render, lambda: [])
    return await respond(job, request, stream if body.stream else None, whole)
