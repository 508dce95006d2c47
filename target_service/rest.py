"""OpenAI-compatible REST API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Extensions beyond OpenAI's fields: top_k, min_p, `speculative` {enabled, gamma, acceptance}, `request_id` + `resume`
(continue a request by id), and in responses the `seed` used and `spec` statistics. Errors use OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from specdec.errors import InvalidRequest
from specdec.spec.sampling import SamplingParams
from specdec.state import StoreUnavailable

from .scheduler import Job, QueueFull
from .service import Forbidden, GenerationSpec, NotFound, TargetService


class Speculative(BaseModel):
    model_config = ConfigDict(extra="forbid")
    enabled: bool = True
    gamma: int | None = None
    acceptance: Literal["rejection", "coupled"] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    speculative: Speculative | None = None
    request_id: str | None = None
    resume: bool = False


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = ""
    echo: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(default_factory=list)


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status, headers)


def create_app(svc: TargetService, metrics=None, api_keys: frozenset[str] = frozenset()) -> FastAPI:
    app = FastAPI(title="specdec target", version="0.1.0")

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, exc: RequestValidationError):
        e = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(x) for x in e.get("loc", ())[1:]) or None
        return error(400, f"{field or 'body'}: {e.get('msg', 'invalid request')}", field)

    def auth(request: Request) -> str | None | JSONResponse:
        if not api_keys:
            return None
        h = request.headers.get("authorization", "")
        key = h[7:] if h.lower().startswith("bearer ") else None
        if key not in api_keys:
            return error(401, "missing or invalid API key (Authorization: Bearer <key>)", kind="authentication_error")
        return key

    def to_spec(body: _Common, prompt: list[int]) -> GenerationSpec:
        if body.n != 1:
            raise InvalidRequest(f"n={body.n} is not supported", field="n", remedy="use n=1 (one choice per request)")
        if body.logprobs not in (None, False, 0):
            raise InvalidRequest("logprobs are not supported", field="logprobs", remedy="leave logprobs unset")
        spec = body.speculative or Speculative()
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), 16)
        return GenerationSpec(prompt, SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                                     min_p=body.min_p, seed=body.seed),
                              max_tokens, tuple(stop), spec.enabled, spec.gamma, spec.acceptance, body.request_id)

    async def start(body: _Common, prompt_fn, key) -> Job:
        if body.resume:
            if not body.request_id:
                raise InvalidRequest("resume needs the request_id", field="request_id")
            return await svc.resume(body.request_id, key)
        return await svc.admit(to_spec(body, prompt_fn()), key)

    async def handle(request: Request, body: _Common, prompt_fn, chat: bool):
        key = auth(request)
        if isinstance(key, JSONResponse):
            return key
        try:
            job = await start(body, prompt_fn, key)
        except InvalidRequest as e:
            return error(400, str(e), e.field)
        except QueueFull as e:
            return error(429, f"server busy: {e}", kind="rate_limit_error", headers={"Retry-After": "1"})
        except StoreUnavailable as e:
            return error(503, f"request state store unavailable: {e}", kind="service_unavailable",
                         headers={"Retry-After": "2"})
        except NotFound as e:
            return error(404, str(e), "request_id", kind="not_found_error")
        except Forbidden as e:
            return error(403, str(e), "request_id", kind="permission_error")
        model = body.model or svc.model_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(request, job, model, chat, include_usage), media_type="text/event-stream")
        text, finish, err = "", None, None
        try:
            while finish is None:
                ev = await job.events.get()
                if ev.error:
                    err = ev.error
                    break
                text += ev.text
                finish = ev.finish_reason
        except asyncio.CancelledError:
            svc.scheduler.cancel(job)
            raise
        if err:
            return error(500, err, kind="server_error")
        return JSONResponse(_completion(job, model, chat, text, finish))

    def _usage(job: Job) -> dict:
        n = len(job.req.output)
        return {"prompt_tokens": len(job.req.prompt), "completion_tokens": n, "total_tokens": len(job.req.prompt) + n}

    def _spec(job: Job) -> dict:
        s = job.req.stats
        return {"steps": s.steps, "drafted": s.drafted, "accepted": s.accepted, "acceptance_rate": s.acceptance_rate,
                "tokens_per_step": s.tokens_per_step(len(job.req.output) - job.resumed_tokens),
                "gamma": job.req.gamma, "acceptance": job.req.mode.value, "resumed_tokens": job.resumed_tokens}

    def _completion(job: Job, model: str, chat: bool, text: str, finish: str) -> dict:
        base = {"id": job.rid, "created": int(time.time()), "model": model, "usage": _usage(job),
                "seed": job.req.params.seed, "spec": _spec(job)}
        if chat:
            return {**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                 "logprobs": None}]}
        return {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    async def _sse(request: Request, job: Job, model: str, chat: bool, include_usage: bool):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(text, finish, first=False):
            if chat:
                delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text or first \
                    else {}
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            d = {"id": job.rid, "object": obj, "created": created, "model": model, "choices": [choice],
                 "seed": job.req.params.seed}
            if include_usage:
                d["usage"] = None
            return f"data: {json.dumps(d)}\n\n"

        first = True
        try:
            while True:
                ev = await job.events.get()
                if ev.error:
                    yield f"data: {json.dumps({'error': {'message': ev.error, 'type': 'server_error'}})}\n\n"
                    break
                if ev.text or ev.finish_reason or first:
                    yield chunk(ev.text, ev.finish_reason, first)
                    first = False
                if ev.finish_reason:
                    if include_usage:
                        d = {"id": job.rid, "object": obj, "created": created, "model": model, "choices": [],
                             "usage": _usage(job), "spec": _spec(job)}
                        yield f"data: {json.dumps(d)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not job.req.finish_reason:
                svc.scheduler.cancel(job)   # client went away mid-stream: free KV and the draft session

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        def prompt():
            p = body.prompt
            if isinstance(p, str):
                return svc.tok.encode(p)
            if p and all(isinstance(x, int) for x in p):
                return list(p)
            raise InvalidRequest("a list of prompts is not supported", field="prompt",
                                 remedy="send one prompt (text or token ids) per request")
        return await handle(request, body, prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatRequest):
        def prompt():
            if not body.messages:
                raise InvalidRequest("messages is empty", field="messages", remedy="send at least one message")
            return svc.tok.chat([m.model_dump() for m in body.messages])
        return await handle(request, body, prompt, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "draft": svc.draft_name}]}

    @app.get("/health")
    async def health():
        ok = await svc.store.ping()
        body = {"status": "ok" if ok else "degraded", "store": "ok" if ok else "unavailable",
                "running": len(svc.scheduler.running), "waiting": len(svc.scheduler.waiting)}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry) if metrics else b"", media_type=CONTENT_TYPE_LATEST)

    return app
