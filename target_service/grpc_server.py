"""gRPC `specdec.v1.Target`: Generate (server-streaming) and Verify (stateless, for external drafters).

Auth: with API keys configured, calls need metadata `authorization: Bearer <key>` (or `x-api-key: <key>`), else
UNAUTHENTICATED; grpc.health.v1 stays open for probes. Requests are parsed here rather than by grpc, so a message
protobuf cannot decode (e.g. a string field that is not UTF-8) is answered INVALID_ARGUMENT, after the key check.
Messages over the receive limit are refused by grpc itself with RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import traceback

import grpc
import torch
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec import wire
from specdec.errors import BackendDead, InvalidRequest, SpecdecError
from specdec.speculative.sampling import SamplingParams
from specdec.state import StoreUnavailable
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pbg

from .scheduler import QueueFull
from .service import Forbidden, GenerationSpec, NotFound, TargetService

log = logging.getLogger("specdec.grpc")
LONG_TEXT = 1 << 16            # tokenize prompts longer than this off the event loop
MAX_MESSAGE_CHARS = 1024
_LONG_QUOTED = re.compile(r"""(['"])([^'"]{40})[^'"]{24,}\1""")


def clip(message: str) -> str:
    """An error message fit to send back: validation messages quote the offending value, and a 1 MB stop string
    quoted in a gRPC status overflows the 16 KB metadata limit (the client then sees RESOURCE_EXHAUSTED 'Stream
    removed' instead of the reason). Long quoted values keep their first 40 characters; the whole message is capped."""
    message = _LONG_QUOTED.sub(lambda m: f"{m[1]}{m[2]}...{m[1]}", message)
    if len(message) > MAX_MESSAGE_CHARS:
        half = MAX_MESSAGE_CHARS // 2 - 3
        message = f"{message[:half]} ... {message[-half:]}"
    return message


def _key(context) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == "authorization" and v[:7].lower() == "bearer ":
            return v[7:].strip()
        if k == "x-api-key":
            return v
    return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def check_q(q, n_drafts: int, vocab_size: int) -> None:
    """Draft distributions from an external drafter, checked before any tensor is built: one per draft token, ids in
    the vocabulary, probabilities finite in [0, 1] summing to 1. (Without the count check, a small message of many
    empty distributions would make a [count, vocab] float64 tensor: a memory bomb.)"""
    if len(q) != n_drafts:
        raise InvalidRequest(f"{len(q)} distributions for {n_drafts} draft tokens", field="q",
                             remedy="send one distribution per draft token, or none (greedy/coupled)")
    for j, d in enumerate(q):
        probs = torch.tensor(list(d.probs), dtype=torch.float64)
        if len(d.ids):
            if len(d.ids) != len(d.probs):
                raise InvalidRequest(f"{len(d.ids)} ids but {len(d.probs)} probs", field=f"q[{j}]")
            ids = torch.tensor(list(d.ids), dtype=torch.long)
            if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
                raise InvalidRequest(f"ids outside the vocabulary [0, {vocab_size})", field=f"q[{j}].ids")
            if ids.unique().numel() != ids.numel():
                raise InvalidRequest("repeated ids", field=f"q[{j}].ids")
        elif len(d.probs) != vocab_size:
            raise InvalidRequest(f"a dense distribution needs {vocab_size} probs, got {len(d.probs)}",
                                 field=f"q[{j}].probs")
        if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()) or bool((probs > 1).any()) \
                or not abs(float(probs.sum()) - 1.0) <= 1e-4:
            raise InvalidRequest("probabilities must be finite, in [0, 1] and sum to 1", field=f"q[{j}].probs")


class TargetServicer(pbg.TargetServicer):
    def __init__(self, svc: TargetService, api_keys: frozenset[str] = frozenset()):
        self.svc, self.api_keys = svc, api_keys
        self._digests = [_digest(k) for k in api_keys]

    def key_ok(self, key: str | None) -> bool:
        if key is None:
            return False
        d, ok = _digest(key), False
        for k in self._digests:       # constant time over the configured keys
            ok |= hmac.compare_digest(d, k)
        return ok

    async def _auth(self, context) -> str | None:
        """The caller's key (None when auth is off: requests then belong to no key, as over REST)."""
        if not self.api_keys:
            return None
        key = _key(context)
        if not self.key_ok(key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key "
                                                                 "(metadata authorization: Bearer <key>)")
        return key

    async def Generate(self, request: pb.GenerateRequest, context):
        key = await self._auth(context)
        # the client's deadline is the request's timeout (clamped to what the service accepts)
        left = context.time_remaining()
        timeout_s = None if left is None else max(0.001, min(left, 86400.0))
        try:
            if request.resume:
                if not request.request_id:
                    raise InvalidRequest("resume needs the request_id", field="request_id")
                job = await self.svc.resume(request.request_id, key, timeout_s=timeout_s)
            else:
                kind = request.WhichOneof("input")
                if kind is None:
                    raise InvalidRequest("no prompt", field="prompt", remedy="set prompt or prompt_ids")
                if kind == "prompt":
                    text = request.prompt
                    prompt = (await asyncio.to_thread(self.svc.tok.encode, text) if len(text) > LONG_TEXT
                              else self.svc.tok.encode(text))
                else:
                    prompt = list(request.prompt_ids.ids)
                sp = request.speculative
                mode = wire.mode_from_pb(sp.mode)
                if sp.mode and mode is None:
                    raise InvalidRequest(f"unknown acceptance mode {sp.mode}", field="speculative.mode",
                                         remedy="use GREEDY, REJECTION or COUPLED")
                spec = GenerationSpec(prompt, wire.params_from_pb(request.sampling), request.max_tokens or 16,
                                      tuple(request.stop), not sp.disabled, sp.gamma or None,
                                      mode.value if mode else None, request.request_id or None,
                                      timeout_s=timeout_s)
                job = await self.svc.admit(spec, key)
        except InvalidRequest as e:
            msg = str(e)
            if e.field == "id":        # the state store's name for it
                msg = "request_" + msg
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip(msg))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {e}")
        except StoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, clip(f"request state store unavailable: {e}"))
        except BackendDead as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, clip(str(e)))
        except NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, clip(f"request_id: {e}"))
        except Forbidden as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, clip(f"request_id: {e}"))
        except SpecdecError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip(str(e)))
        try:
            while True:
                ev = await job.events.get()
                if ev.error:     # retryable: committed tokens are kept, resume=true continues the request
                    await context.abort(grpc.StatusCode.UNAVAILABLE if ev.retryable else grpc.StatusCode.INTERNAL,
                                        ev.error)
                msg = pb.GenerateResponse(request_id=job.rid, tokens=ev.tokens, text=ev.text,
                                          finish_reason=ev.finish_reason or "",
                                          prompt_tokens=len(job.req.prompt), completion_tokens=len(job.req.output))
                if job.req.params.seed is not None:
                    msg.seed = job.req.params.seed
                if ev.finish_reason:
                    s = job.req.stats
                    msg.spec.CopyFrom(pb.SpecStats(steps=s.steps, drafted=s.drafted, accepted=s.accepted,
                                                   tokens_per_step=s.tokens_per_step(
                                                       len(job.req.output) - job.resumed_tokens)))
                yield msg
                if ev.finish_reason:
                    return
        finally:
            if not job.req.finish_reason:
                self.svc.scheduler.cancel(job)   # client cancelled the stream

    async def Verify(self, request: pb.VerifyRequest, context):
        await self._auth(context)
        V = self.svc.vocab_size
        try:
            max_drafts = self.svc.caps.max_gamma
            if len(request.draft_tokens) > max_drafts:
                raise InvalidRequest(f"{len(request.draft_tokens)} draft tokens", field="draft_tokens",
                                     remedy=f"send at most {max_drafts}")
            if len(request.q):
                check_q(request.q, len(request.draft_tokens), V)
            mode = wire.mode_from_pb(request.mode)
            if request.mode and mode is None:
                raise InvalidRequest(f"unknown acceptance mode {request.mode}", field="mode",
                                     remedy="use GREEDY, REJECTION or COUPLED")
            q = wire.dists_from_pb(request.q, V) if len(request.q) else None
            params: SamplingParams = wire.params_from_pb(request.sampling)
            tokens, accepted, seed = await self.svc.verify_block(list(request.context), list(request.draft_tokens), q,
                                                                 params, mode.value if mode else None)
        except SpecdecError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, clip(str(e)))
        resp = pb.VerifyResponse(tokens=tokens, num_accepted=accepted, num_drafted=len(request.draft_tokens))
        if seed is not None:
            resp.seed = seed
        return resp


def _parsed(servicer: TargetServicer, method, request_type, streaming: bool):
    """A handler over raw bytes: key check, then parse (INVALID_ARGUMENT when protobuf refuses the bytes), then the
    servicer's method. An unexpected exception is answered INTERNAL and logged by type and traceback only (its
    message may quote the request)."""
    async def parse(raw: bytes, context):
        await servicer._auth(context)
        try:
            return request_type.FromString(raw)
        except DecodeError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid {request_type.DESCRIPTOR.full_name} ({e}). Send a well-formed "
                                "message; string fields must be valid UTF-8")

    def crashed(context, e: BaseException):
        log.error("unhandled %s in %s:\n%s", type(e).__name__, method.__name__,
                  "".join(traceback.format_tb(e.__traceback__)))
        return context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__})")

    if streaming:
        async def handler(raw, context):
            req = await parse(raw, context)
            try:
                async for msg in method(req, context):
                    yield msg
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as e:  # noqa: BLE001
                await crashed(context, e)
    else:
        async def handler(raw, context):
            req = await parse(raw, context)
            try:
                return await method(req, context)
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as e:  # noqa: BLE001
                await crashed(context, e)
    return handler


def add_target_servicer(servicer: TargetServicer, server) -> None:
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _parsed(servicer, servicer.Generate, pb.GenerateRequest, True),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "Verify": grpc.unary_unary_rpc_method_handler(
            _parsed(servicer, servicer.Verify, pb.VerifyRequest, False),
            response_serializer=pb.VerifyResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specdec.v1.Target", handlers),))


def build_grpc_server(svc: TargetService, host: str, port: int, *, api_keys: frozenset[str] = frozenset(),
                      max_message_mb: int = 64):
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_mb << 20),
                                      ("grpc.max_send_message_length", max_message_mb << 20)])
    add_target_servicer(TargetServicer(svc, api_keys), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    return server, bound, health_servicer


async def set_health(h, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", "specdec.v1.Target"):
        await h.set(name, status)
