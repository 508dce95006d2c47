"""OpenAI-compatible REST API (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Extensions beyond OpenAI's fields: top_k, min_p, `speculative` {enabled, gamma, acceptance}, `request_id` + `resume`
(continue a request by id), `timeout_s`, and in responses the `seed` used and `spec` statistics.

Every error, whatever raised it (body validation, the request validator, auth, an unknown route, a body that is not
JSON or not UTF-8, a body over the size limit, a bug), has OpenAI's shape {"error": {"message", "type", "param",
"code"}}; `param` names the field at fault. The request models are strict (no "5" for 5, no 1 for true, no NaN or
Infinity), and the OpenAPI schema (/openapi.json) documents the ranges the validator enforces, so generated clients
and fuzzers see the real contract.

Auth: with API keys configured every route needs `Authorization: Bearer <key>` (401 otherwise, checked before the body
is read) except /health and /metrics, which stay open for probes and scrapers.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import traceback
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.errors import BackendDead, InvalidRequest, SpecdecError
from specdec.speculative.sampling import SamplingParams
from specdec.speculative.validation import EMBEDDED, MIN_TEMPERATURE, validate_request
from specdec.state import StoreUnavailable

from .grpc_server import clip
from .scheduler import Job, QueueFull
from .service import Forbidden, GenerationSpec, NotFound, TargetService

log = logging.getLogger("specdec.rest")

OPEN_PATHS = frozenset({"/health", "/metrics"})     # no API key needed: liveness probes and Prometheus scrapes
MAX_BODY_BYTES = 16 << 20
INT32_MAX = 2**31 - 1
LONG_TEXT = 1 << 16                                  # tokenize prompts longer than this off the event loop


def _valid_unicode(s: str) -> str:
    # JSON may spell lone UTF-16 surrogates ("\ud800"); they are not text, and would fail later in a tokenizer or
    # the state store's encoder. Refuse them here, naming the field.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains invalid Unicode (an unpaired surrogate such as \\ud800)") from None
    return s


def _integral(v):
    # JSON has one number type and JSON Schema counts 5.0 as an integer: accept integral floats as ints. Strings,
    # booleans, 5.5, NaN and Infinity stay refused (the field is strict).
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


Int = Annotated[int, BeforeValidator(_integral)]
Text = Annotated[str, AfterValidator(_valid_unicode)]
StopText = Annotated[str, StringConstraints(min_length=1, max_length=256), AfterValidator(_valid_unicode)]
RequestId = Annotated[str, StringConstraints(min_length=1, max_length=128), AfterValidator(_valid_unicode)]


def _doc(description: str, **bounds) -> dict:
    """Schema-only bounds: enforced by specdec.speculative.validation (one capability table for REST and gRPC, with the
    remedy in the message); written into the OpenAPI schema so clients and fuzzers know them."""
    return {"description": description, "json_schema_extra": bounds}


def _finite(default, description: str, **bounds):
    return Field(default, allow_inf_nan=False, **_doc(description, **bounds))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Speculative(_Strict):
    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool = True
    gamma: Int | None = Field(None, **_doc("draft block length; unset: the server's default", minimum=1,
                                           maximum=EMBEDDED.max_gamma))
    acceptance: Literal["rejection", "coupled"] | None = Field(
        None, description="for sampled requests; unset: the server's default (coupled: the output is plain seeded "
                          "decoding's; rejection: a few % more accepted drafts, output depends on the proposals)")


class StreamOptions(_Strict):
    include_usage: bool = False


StopList = Annotated[list[StopText], Field(json_schema_extra={"maxItems": EMBEDDED.max_stop})]


class _Common(_Strict):
    model: Text | None = Field(None, description="informational; the server serves one model")
    max_tokens: Int | None = Field(None, **_doc("new tokens; prompt + max_tokens must fit the model context "
                                                "(default 16)", minimum=1))
    max_completion_tokens: Int | None = Field(None, **_doc("the newer name of max_tokens (when both are set they "
                                                           "must agree)", minimum=1))
    temperature: float = _finite(1.0, f"0 = greedy; else in [{MIN_TEMPERATURE}, 100]", minimum=0, maximum=100)
    top_p: float = _finite(1.0, "nucleus sampling; 1 = off", exclusiveMinimum=0, maximum=1)
    top_k: Int = Field(0, ge=0, le=INT32_MAX, description="0 = off")
    min_p: float = _finite(0.0, "0 = off", minimum=0, exclusiveMaximum=1)
    seed: Int | None = Field(None, ge=0, le=2**63 - 1, description="unset for a sampled request: the server picks "
                                                                   "one and returns it")
    stop: StopText | StopList | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Int = Field(1, **_doc("only 1 is supported", minimum=1, maximum=1))
    speculative: Speculative | None = None
    request_id: RequestId | None = Field(None, description="optional id for the request (else a random one); "
                                                            "with resume=true, the request to continue")
    resume: bool = False
    timeout_s: float | None = _finite(None, "deadline for the whole request (queue + generation), seconds",
                                      exclusiveMinimum=0, maximum=86400)


class CompletionRequest(_Common):
    prompt: Text | list[Int] | list[Text] = Field(
        "", **_doc("text, token ids, or a list holding one text; required unless resume=true", minLength=1,
                   minItems=1))
    echo: bool = Field(False, **_doc("not supported", enum=[False]))
    logprobs: Int | None = Field(None, **_doc("not supported", enum=[0, None]))


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text


class ChatRequest(_Common):
    messages: list[Message] = Field(default_factory=list, **_doc("the conversation; required unless resume=true",
                                                                 minItems=1))
    logprobs: bool | None = Field(None, **_doc("not supported", enum=[False, None]))


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorBody


_ERRORS = {400: "invalid request (the message names the field and the remedy)", 401: "missing or invalid API key",
           403: "the request belongs to another API key", 404: "no such request or route",
           413: "request body too large", 429: "server busy; retry after Retry-After seconds",
           500: "internal error",
           503: "request state store unavailable, or generation failed with the committed tokens kept (resume by id)"}
_RESPONSES: dict[int | str, dict[str, Any]] = {k: {"model": ErrorResponse, "description": v}
                                               for k, v in _ERRORS.items()}


def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
          headers: dict | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": clip(message), "type": kind, "param": param, "code": code}}, status,
                        headers)


# ---------------------------------------------------------------------------------------------------- validation

_UNION_FIELDS = {"prompt": "a string, a list of token ids, or a list holding one string",
                 "stop": "a string or a list of strings"}


_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_tag(part) -> bool:
    """A pydantic location part that is not a field: a union member ('list[int]') or a validator
    ('function-after[...]')."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TAGS)


def _field(loc) -> str | None:
    """'speculative.gamma', 'messages[0].content', 'prompt[3]' from a pydantic error location (tags dropped)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_tag(part):
            out += ("." if out else "") + part
    return out or None


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for the first thing wrong with a body."""
    if not errors:
        return "invalid request body", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'decode error')})", None
    field = _field(tuple(e.get("loc", ())))
    if field is None:
        if isinstance(e.get("input"), (bytes, bytearray)):
            return "the body must be a JSON object sent with Content-Type: application/json", None
        return f"the body must be a JSON object ({e.get('msg', 'invalid')})", None
    top = field.split(".")[0].split("[")[0]
    if any(_is_tag(p) for p in e.get("loc", ())[1:]):
        # a union field (prompt, stop): the error of the member whose type matched (a bad value inside it) is the
        # useful one; when no member's type matched, say which types are accepted
        same = [x for x in errors if (_field(tuple(x.get("loc", ()))) or "").split(".")[0].split("[")[0] == top]
        valued = [x for x in same if not x.get("type", "").endswith("_type")]
        if valued:
            e, field = valued[0], _field(tuple(valued[0].get("loc", ())))
        elif top in _UNION_FIELDS:
            return f"{top}: must be {_UNION_FIELDS[top]}", top
    msg = "unknown field" if e.get("type") == "extra_forbidden" else e.get("msg", "invalid value")
    return f"{field}: {msg}", field


# ---------------------------------------------------------------------------------------------------- middleware

class _Guard:
    """Pure ASGI, before routing: API key check (so an unauthenticated caller cannot make us read or parse a body),
    then the body size limit (Content-Length up front, chunked bodies as they arrive)."""

    def __init__(self, app, api_keys: frozenset[str], max_body: int):
        self.app, self.max_body = app, max_body
        self.digests = [hashlib.sha256(k.encode()).digest() for k in api_keys]

    def key_ok(self, key: str | None) -> bool:
        if key is None:
            return False
        d = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        ok = False
        for k in self.digests:        # constant time over the configured keys
            ok |= hmac.compare_digest(d, k)
        return ok

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        key = None
        h = headers.get("authorization", "")
        if h[:7].lower() == "bearer ":
            key = h[7:].strip()
        if self.digests and scope.get("path") not in OPEN_PATHS:
            if not self.key_ok(key):
                return await error(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                                   kind="authentication_error", code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        scope.setdefault("state", {})["api_key"] = key if self.digests else None
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await error(400, "invalid Content-Length header")(scope, receive, send)
            if int(length) > self.max_body:
                return await self._too_large(scope, receive, send)
            return await self._run(scope, receive, send)
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return await self._run(scope, receive, send)
        # no Content-Length (chunked): buffer up to the limit, then replay
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body:
                return await self._too_large(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_again():
            return replay.pop() if replay else await receive()

        return await self._run(scope, receive_again, send)

    async def _run(self, scope, receive, send):
        """The app, with any exception it lets out answered 500 in OpenAI's shape. Logged by type and traceback
        only: an exception's message may quote the request (prompt text), and prompts stay out of the logs."""
        started = False

        async def send_tracking(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as e:  # noqa: BLE001 - one request's bug must not show as a bare 500 or kill the server
            tb = "".join(traceback.format_tb(e.__traceback__))
            log.error("unhandled %s in %s %s:\n%s", type(e).__name__, scope.get("method"), scope.get("path"), tb)
            if not started:
                await error(500, "internal server error", kind="server_error")(scope, receive, send)

    async def _too_large(self, scope, receive, send):
        return await error(413, f"the request body is larger than {self.max_body} bytes", kind="invalid_request_error",
                           code="request_too_large")(scope, receive, send)


# ---------------------------------------------------------------------------------------------------- the app

def create_app(svc: TargetService, metrics=None, api_keys: frozenset[str] = frozenset(), *,
               max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="specdec target", version="0.1.0",
                  description="OpenAI-compatible completions with disaggregated speculative decoding. Errors use "
                              "OpenAI's shape. With API keys configured, every route except /health and /metrics "
                              "needs Authorization: Bearer <key>.")
    app.add_middleware(_Guard, api_keys=frozenset(api_keys), max_body=max_body_bytes)
    vocab, context = svc.engine.vocab_size, svc.engine.cfg.max_seq_len

    @app.exception_handler(RequestValidationError)
    async def bad_body(_, exc: RequestValidationError):
        message, field = _validation_message(list(exc.errors()))
        return error(400, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return error(404, "unknown route", kind="invalid_request_error", code="unknown_url")
        if exc.status_code == 405:
            return error(405, "method not allowed on this route", code="method_not_allowed",
                         headers=getattr(exc, "headers", None))
        if exc.status_code == 400:       # FastAPI: the body could not be read (not UTF-8, numbers too long, nesting)
            cause = exc.__cause__
            why = ("it is not valid UTF-8" if isinstance(cause, UnicodeDecodeError) else
                   "it nests too deeply" if isinstance(cause, RecursionError) else
                   "a number in it is too long" if isinstance(cause, ValueError) else "it is malformed")
            return error(400, f"the body could not be parsed as JSON: {why}")
        if exc.status_code == 413:
            return error(413, "the request body is too large", code="request_too_large")
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), kind=kind, headers=getattr(exc, "headers", None))

    def to_spec(body: _Common, prompt: list[int]) -> GenerationSpec:
        if body.n != 1:
            raise InvalidRequest(f"n={body.n} is not supported", field="n", remedy="use n=1 (one choice per request)")
        if body.logprobs not in (None, False, 0):
            raise InvalidRequest("logprobs are not supported", field="logprobs", remedy="leave logprobs unset")
        if getattr(body, "echo", False):
            raise InvalidRequest("echo is not supported", field="echo", remedy="leave echo unset")
        spec = body.speculative or Speculative()
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if None not in (body.max_tokens, body.max_completion_tokens) and body.max_tokens != body.max_completion_tokens:
            raise InvalidRequest(f"max_tokens={body.max_tokens} and max_completion_tokens="
                                 f"{body.max_completion_tokens} disagree", field="max_tokens",
                                 remedy="send one of them (max_completion_tokens is the newer name)")
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), 16)
        return GenerationSpec(prompt, SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                                     min_p=body.min_p, seed=body.seed),
                              max_tokens, tuple(stop), spec.enabled, spec.gamma, spec.acceptance, body.request_id,
                              timeout_s=body.timeout_s)

    async def check_ignored(body: _Common, prompt_fn) -> None:
        """A resumed request continues with its recorded prompt and parameters and ignores the body's (SDKs make
        some of them mandatory); a field that is present must still be valid, as for a new request."""
        given = body.model_fields_set
        prompt = await prompt_fn() if given & {"prompt", "messages"} else [1]
        spec = to_spec(body, prompt)
        max_tokens = spec.max_tokens if given & {"max_tokens", "max_completion_tokens"} else 1
        gamma = spec.gamma if spec.gamma is not None else (svc.gamma if spec.speculative else 1)
        validate_request(prompt, spec.params, max_tokens, gamma, spec.mode or svc.mode, svc.caps, vocab, context,
                         stop=spec.stop)

    async def start(body: _Common, prompt_fn, key) -> Job:
        if body.resume:
            if not body.request_id:
                raise InvalidRequest("resume needs the request_id", field="request_id")
            await check_ignored(body, prompt_fn)
            return await svc.resume(body.request_id, key, timeout_s=body.timeout_s)
        return await svc.admit(to_spec(body, await prompt_fn()), key)

    async def encode(text: str) -> list[int]:
        if len(text) > LONG_TEXT:            # a long text takes a real tokenizer a while: keep the loop answering
            return await asyncio.to_thread(svc.tok.encode, text)
        return svc.tok.encode(text)

    async def handle(request: Request, body: _Common, prompt_fn, chat: bool):
        key = request.scope.get("state", {}).get("api_key")
        try:
            job = await start(body, prompt_fn, key)
        except InvalidRequest as e:
            if e.field == "id":            # the state store's name for it
                return error(400, f"request_{e}", "request_id")
            return error(400, str(e), e.field)
        except QueueFull as e:
            return error(429, f"server busy: {e}", kind="rate_limit_error", headers={"Retry-After": "1"},
                         code="rate_limit_exceeded")
        except StoreUnavailable as e:
            return error(503, f"request state store unavailable: {e}", kind="service_unavailable",
                         headers={"Retry-After": "2"})
        except BackendDead as e:
            return error(503, str(e), kind="service_unavailable", headers={"Retry-After": "5"})
        except NotFound as e:
            return error(404, f"request_id: {e}", "request_id", kind="not_found_error")
        except Forbidden as e:
            return error(403, f"request_id: {e}", "request_id", kind="permission_error")
        except SpecdecError as e:            # e.g. chat on a model without a chat template
            return error(400, str(e), e.field)
        model = body.model or svc.model_name
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(request, job, model, chat, include_usage), media_type="text/event-stream")
        text, finish, err, retryable = "", None, None, False
        try:
            while finish is None:
                ev = await job.events.get()
                if ev.error:
                    err, retryable = ev.error, ev.retryable
                    break
                text += ev.text
                finish = ev.finish_reason
        except asyncio.CancelledError:
            svc.scheduler.cancel(job)
            raise
        if err and retryable:                # committed tokens are kept: the client resumes by id
            return error(503, err, "request_id", kind="service_unavailable", code="resume_request",
                         headers={"Retry-After": "1"})
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
                    err = {"error": {"message": ev.error, "param": "request_id" if ev.retryable else None,
                                     **({"type": "service_unavailable", "code": "resume_request"} if ev.retryable
                                        else {"type": "server_error", "code": None})}}
                    yield f"data: {json.dumps(err)}\n\n"
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

    ok_stream = {200: {"description": "the completion (JSON), or with stream=true server-sent events",
                       "content": {"text/event-stream": {}}}}

    @app.post("/v1/completions", responses={**_RESPONSES, **ok_stream})
    async def completions(request: Request, body: CompletionRequest):
        async def prompt():
            p = body.prompt
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
                p = p[0]                     # OpenAI's "list of prompts", with one prompt
            if isinstance(p, str):
                return await encode(p)
            if all(isinstance(x, int) for x in p):
                return list(p)
            raise InvalidRequest("a list of several prompts is not supported", field="prompt",
                                 remedy="send one prompt (text or token ids) per request")
        return await handle(request, body, prompt, chat=False)

    @app.post("/v1/chat/completions", responses={**_RESPONSES, **ok_stream})
    async def chat_completions(request: Request, body: ChatRequest):
        async def prompt():
            if not body.messages:
                raise InvalidRequest("messages is empty", field="messages", remedy="send at least one message")
            msgs = [m.model_dump() for m in body.messages]
            try:
                if sum(len(m["content"]) for m in msgs) > LONG_TEXT:
                    return await asyncio.to_thread(svc.tok.chat, msgs)
                return svc.tok.chat(msgs)
            except SpecdecError:
                raise
            except Exception as e:  # noqa: BLE001 - the chat template refused them (roles, order)
                raise InvalidRequest(f"the model's chat template cannot render them ({type(e).__name__})",
                                     field="messages") from None
        return await handle(request, body, prompt, chat=True)

    @app.get("/v1/models", responses={401: _RESPONSES[401]})
    async def models():
        return {"object": "list", "data": [{"id": svc.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "draft": svc.draft_name}]}

    @app.get("/health")
    async def health():
        store_ok = await svc.store.ping()
        backend_ok = (svc.engine.healthy() and not svc.scheduler.backend_dead
                      and await asyncio.to_thread(svc.engine.reachable))   # a remote model may be away a while
        ok = store_ok and backend_ok
        body = {"status": "ok" if ok else "degraded", "store": "ok" if store_ok else "unavailable",
                "backend": "ok" if backend_ok else "down",
                "running": len(svc.scheduler.running), "waiting": len(svc.scheduler.waiting)}
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus text exposition"}})
    async def prom():
        return Response(generate_latest(metrics.registry) if metrics else b"", media_type=CONTENT_TYPE_LATEST)

    def openapi():
        """FastAPI's schema, plus what only the running server knows: the vocabulary and the context length, and the
        bearer scheme when keys are configured."""
        if app.openapi_schema:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        comps = schema.get("components", {}).get("schemas", {})
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)      # never sent: body errors are OpenAI-shaped 400s
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
        for name, needs in (("CompletionRequest", "prompt"), ("ChatRequest", "messages")):
            model = comps.get(name, {})
            props = model.get("properties", {})
            # the input is required, except when resuming a request by id
            model.update({"if": {"properties": {"resume": {"const": True}}, "required": ["resume"]},
                          "then": {"required": ["request_id"], "properties": {"request_id": {"type": "string"}}},
                          "else": {"required": [needs]}})
            if "temperature" in props:
                t = props["temperature"]
                t.pop("minimum", None)
                t.pop("maximum", None)
                t["anyOf"] = [{"const": 0}, {"minimum": MIN_TEMPERATURE, "maximum": 100}]
            for f in ("max_tokens", "max_completion_tokens"):
                if f in props:
                    props[f]["maximum"] = context - 1
            for s in props.get("prompt", {}).get("anyOf", []):
                if s.get("type") == "array" and s.get("items", {}).get("type") == "integer":
                    s["items"].update(minimum=0, maximum=vocab - 1)
                    s["maxItems"] = context - 1
                elif s.get("type") == "array":
                    s["maxItems"] = 1
        if api_keys:
            schema["components"].setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
            for path, ops in schema.get("paths", {}).items():
                if path not in OPEN_PATHS:
                    for op in ops.values():
                        op["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
    return app
