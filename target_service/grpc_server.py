"""gRPC `specdec.v1.Target`: Generate (server-streaming) and Verify (stateless, for external drafters)."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec import wire
from specdec.errors import InvalidRequest
from specdec.spec.sampling import SamplingParams
from specdec.state import StoreUnavailable
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pbg

from .scheduler import QueueFull
from .service import Forbidden, GenerationSpec, NotFound, TargetService


def _key(context) -> str | None:
    for k, v in context.invocation_metadata():
        if k == "authorization" and v.lower().startswith("bearer "):
            return v[7:]
        if k == "x-api-key":
            return v
    return None


class TargetServicer(pbg.TargetServicer):
    def __init__(self, svc: TargetService, api_keys: frozenset[str] = frozenset()):
        self.svc, self.api_keys = svc, api_keys

    async def _auth(self, context) -> str | None:
        key = _key(context)
        if self.api_keys and key not in self.api_keys:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid API key "
                                                                 "(metadata authorization: Bearer <key>)")
        return key

    async def Generate(self, request: pb.GenerateRequest, context):
        key = await self._auth(context)
        try:
            if request.resume:
                if not request.request_id:
                    raise InvalidRequest("resume needs the request_id", field="request_id")
                job = await self.svc.resume(request.request_id, key)
            else:
                kind = request.WhichOneof("input")
                if kind is None:
                    raise InvalidRequest("no prompt", field="prompt", remedy="set prompt or prompt_ids")
                prompt = self.svc.tok.encode(request.prompt) if kind == "prompt" else list(request.prompt_ids.ids)
                sp = request.speculative
                spec = GenerationSpec(prompt, wire.params_from_pb(request.sampling), request.max_tokens or 16,
                                      tuple(request.stop), not sp.disabled, sp.gamma or None,
                                      (wire.mode_from_pb(sp.mode) or None) and wire.mode_from_pb(sp.mode).value,
                                      request.request_id or None)
                job = await self.svc.admit(spec, key)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"server busy: {e}")
        except StoreUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"request state store unavailable: {e}")
        except NotFound as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except Forbidden as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        try:
            while True:
                ev = await job.events.get()
                if ev.error:
                    await context.abort(grpc.StatusCode.INTERNAL, ev.error)
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
        try:
            q = wire.dists_from_pb(request.q, self.svc.vocab_size) if len(request.q) else None
            params: SamplingParams = wire.params_from_pb(request.sampling)
            mode = wire.mode_from_pb(request.mode)
            tokens, accepted, seed = await self.svc.verify_block(list(request.context), list(request.draft_tokens), q,
                                                                 params, mode.value if mode else None)
        except InvalidRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (ValueError, IndexError) as e:   # malformed distributions (ids out of range, length mismatch)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"q: {e}")
        resp = pb.VerifyResponse(tokens=tokens, num_accepted=accepted, num_drafted=len(request.draft_tokens))
        if seed is not None:
            resp.seed = seed
        return resp


def build_grpc_server(svc: TargetService, host: str, port: int, *, api_keys: frozenset[str] = frozenset(),
                      max_message_mb: int = 64):
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", max_message_mb << 20),
                                      ("grpc.max_send_message_length", max_message_mb << 20)])
    pbg.add_TargetServicer_to_server(TargetServicer(svc, api_keys), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    return server, bound, health_servicer


async def set_health(h, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", "specdec.v1.Target"):
        await h.set(name, status)
