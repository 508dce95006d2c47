"""The gRPC draft server: `specdec.v1.Drafter` (Propose, Release) over one drafter, plus grpc.health.v1.

One Propose drafts all of its items in one `drafter.propose` call (the drafter batches the engine forwards). That call
runs in a worker thread so the event loop keeps answering health checks, and under one lock because the drafter owns
one engine and its sessions. Sessions are keyed by request id; keeping them in sync by committed length and bounding
their memory (LRU eviction of idle sessions' KV) is the drafter's job. Every item is checked before anything runs, so
a bad request is refused whole (INVALID_ARGUMENT naming the field) and never leaves a half-made session.

Security: the server binds loopback unless told otherwise (--host). With --auth-token (env SPECDEC_DRAFT_TOKEN) every
Drafter call needs metadata `authorization: Bearer <token>` (UNAUTHENTICATED otherwise); grpc.health.v1 stays open for
probes. With --tls-cert/--tls-key the port speaks TLS only (a plain-text client cannot connect). Requests are parsed
here rather than by grpc, after the token check, so bytes protobuf refuses (a string field that is not UTF-8) are
answered INVALID_ARGUMENT; messages over --max-message-mb are refused by grpc with RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import signal
import sys
import time

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from specdec import compute, wire
from specdec.errors import InvalidRequest, KVPoolExhausted, SpecdecError
from specdec.speculative.accept import Mode
from specdec.speculative.propose import Drafter, DraftItem
from specdec.speculative.validation import validate_sampling
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

log = logging.getLogger("draft_service")

SERVICE = pb.DESCRIPTOR.services_by_name["Drafter"].full_name     # "specdec.v1.Drafter"
MAX_GAMMA = 64
MAX_ALTS = 8          # alternatives a slot (ProposeItem.alts)
MAX_REQUEST_ID = 256
_PB_MODES = {pb.ACCEPTANCE_MODE_UNSPECIFIED, pb.GREEDY, pb.REJECTION, pb.COUPLED}


def _limits(drafter: Drafter) -> tuple[int | None, int | None]:
    """(vocabulary size, context length) of a model drafter; (None, None) for one without a model (n-gram)."""
    engine = getattr(drafter, "engine", None)
    if engine is None:
        return getattr(drafter, "vocab_size", None), getattr(drafter, "max_len", None)
    return engine.vocab_size, engine.cfg.max_seq_len


def check_item(k: int, m: pb.ProposeItem, vocab_size: int | None, max_len: int | None,
               feature_width: int = 0) -> DraftItem:
    """The library item for a wire item, or InvalidRequest naming the field (items[k].<field>)."""
    def bad(field: str, message: str, remedy: str | None = None):
        raise InvalidRequest(message, field=f"items[{k}].{field}", remedy=remedy)

    if not 0 < len(m.request_id) <= MAX_REQUEST_ID:
        bad("request_id", f"{len(m.request_id)} characters", f"send 1..{MAX_REQUEST_ID}")
    if m.mode not in _PB_MODES:
        bad("mode", f"unknown acceptance mode {m.mode}", "use GREEDY, REJECTION or COUPLED")
    s = m.sampling
    # params_from_pb reads top_p <= 0 as "off"; only 0 means that on the wire, so refuse negatives and NaN here.
    if math.isnan(s.top_p) or s.top_p < 0:
        bad("sampling.top_p", f"{s.top_p!r} is out of range", "use 0 (off) or a value in (0, 1]")
    if m.features:
        row_bytes = 2 * feature_width
        if not row_bytes:
            bad("features", "this drafter reads no hidden states", "send none")
        if len(m.features) % row_bytes:
            bad("features", f"{len(m.features)} bytes is not whole rows of {row_bytes} (bfloat16 x {feature_width})")
        if m.features_start + len(m.features) // row_bytes > max(0, m.committed_len - 1):
            bad("features_start", f"rows {m.features_start}..{m.features_start + len(m.features) // row_bytes - 1} "
                "reach the anchor or beyond", "send rows of committed positions before the anchor only")
    item = wire.item_from_pb(m, feature_width)
    try:
        validate_sampling(item.params)
    except InvalidRequest as e:
        bad(f"sampling.{e.field}", e.detail, e.remedy)
    if item.params.greedy:
        mode = Mode.GREEDY                 # greedy requests accept greedily whatever the mode says
    elif m.mode == pb.ACCEPTANCE_MODE_UNSPECIFIED:
        mode = Mode.COUPLED                # the default acceptance for sampled requests (as on the target)
    else:
        mode = item.mode
    if mode is not Mode.GREEDY and item.params.seed is None:
        bad("sampling.seed", "sampled drafting needs the request's seed",
            "send the seed the target chose at admission")
    if not 1 <= m.gamma <= MAX_GAMMA:
        bad("gamma", f"{m.gamma} is out of range", f"use 1..{MAX_GAMMA}")
    if m.alts > MAX_ALTS:
        bad("alts", f"{m.alts} alternatives a slot is out of range", f"use 0..{MAX_ALTS}")
    for field, toks in (("new_tokens", m.new_tokens), ("context", m.context)):
        for t in toks:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                bad(field, f"token id {t} is outside the vocabulary [0, {vocab_size or 'V'})")
    n = m.committed_len
    if n < 1:
        bad("committed_len", "0: a draft block needs at least one committed token (the anchor)")
    if n < len(m.new_tokens):
        bad("committed_len", f"{n} is less than the {len(m.new_tokens)} new tokens")
    if max_len is not None and n > max_len:
        bad("committed_len", f"{n} exceeds the draft model's context of {max_len}")
    if len(m.context):
        if len(m.context) != n:
            bad("context", f"{len(m.context)} tokens, but committed_len is {n}", "send all committed tokens")
        if m.new_tokens and list(m.context[n - len(m.new_tokens):]) != list(m.new_tokens):
            bad("context", "does not end with new_tokens")
    return dataclasses.replace(item, mode=mode)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


def _bearer(context) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == "authorization" and v[:7].lower() == "bearer ":
            return v[7:].strip()
    return None


class DrafterServicer(pb_grpc.DrafterServicer):
    def __init__(self, drafter: Drafter, auth_token: str | None = None):
        self.drafter = drafter
        self.vocab_size, self.max_len = _limits(drafter)
        self._lock = asyncio.Lock()        # one engine: torch forwards and session tables are not re-entrant
        self._token = _digest(auth_token) if auth_token else None

    async def _auth(self, context) -> None:
        if self._token is None:
            return
        got = _bearer(context)
        if got is None or not hmac.compare_digest(_digest(got), self._token):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid draft token (metadata authorization: Bearer <token>)")

    async def _exclusive(self, fn, *args):
        """fn(*args) on the torch thread (specdec/compute.py), holding the lock until it is done, even when the RPC
        that asked is cancelled (a cancelled await must not let the next call into the engine while this one still
        runs)."""
        async def run():
            async with self._lock:
                return await compute.run(fn, *args)

        task = asyncio.ensure_future(run())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # an abandoned task's error is not news
        return await asyncio.shield(task)

    def _propose(self, items: list[DraftItem]) -> tuple[list[pb.Proposal], float]:
        """The answers, and the ms spent in the drafter itself (for the debug log)."""
        t0 = time.perf_counter()
        try:
            answers = self.drafter.propose(items)
        except Exception:
            # A batch that failed midway may have half-updated its sessions; drop them so they come back whole
            # through NEED_CONTEXT instead of drafting from a wrong state.
            for it in items:
                self.drafter.release(it.sid)
            raise
        drafter_ms = (time.perf_counter() - t0) * 1e3
        return [pb.Proposal(status=pb.Proposal.NEED_CONTEXT) if a is None else wire.proposal_to_pb(a)
                for a in answers], drafter_ms

    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        await self._auth(context)
        t0 = time.perf_counter()
        try:
            items = [check_item(k, m, self.vocab_size, self.max_len, self.drafter.feature_width)
                     for k, m in enumerate(request.items)]
            seen = set()
            for k, it in enumerate(items):
                if it.sid in seen:
                    raise InvalidRequest("appears twice in one Propose", field=f"items[{k}].request_id",
                                         remedy="send each request once per call")
                seen.add(it.sid)
        except InvalidRequest as e:
            log.info("propose refused: %s", e.field)       # the field only: messages may quote token ids
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        proposals, failure, drafter_ms = [], None, 0.0
        if items:
            try:
                proposals, drafter_ms = await self._exclusive(self._propose, items)
            except KVPoolExhausted as e:
                log.warning("propose: draft KV pool exhausted (%d items)", len(items))
                failure = (grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except SpecdecError as e:
                failure = (grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:       # one bad batch must not take the server down
                log.exception("propose failed (%d items)", len(items))
                failure = (grpc.StatusCode.INTERNAL, f"draft failed: {type(e).__name__}")
        if failure is not None:
            await context.abort(*failure)
        lost = sum(p.status == pb.Proposal.NEED_CONTEXT for p in proposals)
        log.debug("propose: %d items, %d need context, %.1f ms (drafter %.1f ms)", len(items), lost,
                  1e3 * (time.perf_counter() - t0), drafter_ms)
        return pb.ProposeResponse(proposals=proposals, drafter=self.drafter.name,
                                  feature_layers=self.drafter.feature_layers,
                                  feature_window=self.drafter.feature_window)

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        await self._auth(context)
        ids = list(request.request_ids)

        def release():
            self.drafter.release_all(ids)     # unknown ids are a no-op

        if ids:
            await self._exclusive(release)
        return pb.ReleaseResponse()


def _parsed(servicer: DrafterServicer, method, request_type):
    """A handler over raw bytes: token check, then parse (INVALID_ARGUMENT when protobuf refuses the bytes), then
    the servicer's method."""
    async def handler(raw: bytes, context):
        await servicer._auth(context)
        try:
            request = request_type.FromString(raw)
        except DecodeError as e:
            log.info("%s refused: unparseable request", method.__name__)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request: not a valid {request_type.DESCRIPTOR.full_name} ({e}). Send a well-formed "
                                "message; string fields must be valid UTF-8")
        return await method(request, context)
    return handler


def add_drafter_servicer(servicer: DrafterServicer, server) -> None:
    handlers = {
        "Propose": grpc.unary_unary_rpc_method_handler(_parsed(servicer, servicer.Propose, pb.ProposeRequest),
                                                       response_serializer=pb.ProposeResponse.SerializeToString),
        "Release": grpc.unary_unary_rpc_method_handler(_parsed(servicer, servicer.Release, pb.ReleaseRequest),
                                                       response_serializer=pb.ReleaseResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _pem(x: bytes | str | os.PathLike) -> bytes:
    if isinstance(x, bytes):
        return x
    with open(x, "rb") as f:
        return f.read()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Health(HealthServicer):
    """grpc_health's asyncio servicer, SERVING for the server and the Drafter service from the start. Its `set` is a
    coroutine and build_server is not; before the server starts nobody watches, so the table is seeded directly."""

    def __init__(self, services: tuple[str, ...]):
        super().__init__()
        for s in services:
            self._server_status[s] = health_pb2.HealthCheckResponse.SERVING


def build_server(drafter: Drafter, host: str = "127.0.0.1", port: int = 0, max_message_mb: int = 64, *,
                 auth_token: str | None = None, tls_cert: bytes | str | None = None,
                 tls_key: bytes | str | None = None) -> tuple[grpc.aio.Server, int]:
    """An unstarted grpc.aio server for `drafter` and the bound port (port 0 picks a free one). Call it inside the
    event loop that will run the server. `server.health` is its health servicer (for graceful shutdown).
    auth_token: Drafter calls need `authorization: Bearer <token>`; tls_cert + tls_key (PEM bytes or paths): TLS
    only."""
    if (tls_cert is None) != (tls_key is None):
        raise SpecdecError("TLS needs both a certificate and its key", field="tls_cert",
                           remedy="pass both --tls-cert and --tls-key, or neither")
    limit = max_message_mb * 1024 * 1024      # dense draft distributions: gamma x vocab float64 per sampled item
    # grpc turns SO_REUSEPORT on by default: a second server on a busy port would silently share it.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", limit), ("grpc.so_reuseport", 0)])
    add_drafter_servicer(DrafterServicer(drafter, auth_token), server)
    server.health = _Health(("", SERVICE))
    health_pb2_grpc.add_HealthServicer_to_server(server.health, server)
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    if tls_cert is not None:
        creds = grpc.ssl_server_credentials([(_pem(tls_key), _pem(tls_cert))])
        bound = server.add_secure_port(address, creds)     # raises when the address cannot be bound
    else:
        bound = server.add_insecure_port(address)
    return server, bound


def make_drafter_from_args(args: argparse.Namespace) -> Drafter:
    from specdec.draft import make_drafter, needs_target
    from specdec.engine.backend import check_device

    check_device(args.device)                 # a clear error before any weights load
    target = None
    if needs_target(args.drafter):
        from specdec.engine.registry import load
        target = load(args.target_model, args.dtype, quant=args.quant).model
    return make_drafter(args.drafter, target, dtype=args.dtype, kv_tokens=args.kv_tokens, skip=args.draft_layers,
                        batch_invariant=args.batch_invariant, device=args.device, quant=args.quant,
                        checkpoint=args.draft_checkpoint, features="wire", vocab=args.draft_vocab,
                        min_conf=args.draft_min_conf)


async def serve(args: argparse.Namespace) -> None:
    """Load the drafter, serve until SIGTERM/SIGINT, then drain: health NOT_SERVING, in-flight calls get 5 s."""
    compute.keep_freed_memory()
    if args.threads:
        import torch
        await compute.run(torch.set_num_threads, args.threads)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Loading takes seconds (real models); in a thread, so a signal meanwhile still ends the process cleanly.
    drafter = await compute.run(make_drafter_from_args, args)
    if stop.is_set():
        return
    from specdec.draft import warm_up
    ms = await compute.run(warm_up, drafter, _limits(drafter)[0])
    print(f"draft server: warm-up {'failed' if ms is None else f'{ms:.0f} ms'}", flush=True)
    try:
        server, port = build_server(drafter, args.host, args.port, args.max_message_mb, auth_token=args.auth_token,
                                    tls_cert=args.tls_cert, tls_key=args.tls_key)
    except RuntimeError as e:             # grpc's "failed to bind"
        raise SpecdecError(f"cannot listen on {args.host}:{args.port} ({e})", field="port",
                           remedy="pick a free port or another --host") from None
    log.info("start-up objects frozen: %d", compute.settle_heap())
    await server.start()
    security = ", ".join(x for x in ("TLS" if args.tls_cert else "", "token auth" if args.auth_token else "") if x)
    print(f"draft server: drafter {drafter.name} on {args.host}:{port} ({security or 'plain text, no auth'})",
          flush=True)
    if not is_loopback(args.host) and not (args.auth_token and args.tls_cert):
        log.warning("serving on %s without %s: anyone who can reach the port can use the drafter", args.host,
                    " and ".join(x for x in ("--auth-token" if not args.auth_token else "",
                                             "TLS (--tls-cert/--tls-key)" if not args.tls_cert else "") if x))
    await stop.wait()
    log.info("draft server: shutting down")
    await server.health.enter_graceful_shutdown()
    await server.stop(grace=5)


def _env(name: str, default):
    return os.environ.get(name, default)


def _env_flag(name: str, default: bool) -> bool:
    """0/false/no/off is False, any other value True, unset or empty the default."""
    v = os.environ.get(name, "").strip().lower()
    return default if not v else v not in ("0", "false", "no", "off")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from specdec.engine.quant import MODES as QUANT_MODES
    from specdec.cli import add_draft_min_conf_arg, add_draft_vocab_arg
    p = argparse.ArgumentParser(prog="python -m draft_service", description="specdec gRPC draft server")
    p.add_argument("--host", default=_env("SPECDEC_DRAFT_HOST", "127.0.0.1"),
                   help="bind address (loopback by default; 0.0.0.0 to serve other hosts) [SPECDEC_DRAFT_HOST]")
    p.add_argument("--port", type=int, default=int(_env("SPECDEC_DRAFT_PORT", 50061)), help="[SPECDEC_DRAFT_PORT]")
    p.add_argument("--drafter", default=_env("SPECDEC_DRAFTER", "ngram"),
                   help="ngram | corpus (the target's own past text) | layer-skip | block (trained, on the target's "
                        "hidden states) | a draft model preset or path; NAME+ngram: prompt lookup where the context "
                        "repeats, NAME elsewhere; NAME+ngram+corpus: the corpus where the context has no match "
                        "[SPECDEC_DRAFTER]")
    p.add_argument("--target-model", default=_env("SPECDEC_TARGET_MODEL", "smollm2-135m"),
                   help="the target model whose layers layer-skip keeps (block: whose embedding it shares) "
                        "[SPECDEC_TARGET_MODEL]")
    p.add_argument("--draft-checkpoint", default=_env("SPECDEC_DRAFT_CHECKPOINT", None),
                   help="block: a trained drafter's directory (default: the one shipped for --target-model); the "
                        "target sends its hidden states with each Propose [SPECDEC_DRAFT_CHECKPOINT]")
    p.add_argument("--draft-layers", default=_env("SPECDEC_DRAFT_LAYERS", None),
                   help="layer-skip: target layers to keep, e.g. 0-11,18-29 [SPECDEC_DRAFT_LAYERS]")
    p.add_argument("--dtype", default=_env("SPECDEC_DTYPE", None),
                   help="bf16 (default for real models) | fp32 | fp64 (default for tiny-*) [SPECDEC_DTYPE]")
    p.add_argument("--device", default=_env("SPECDEC_DEVICE", "cpu"),
                   help="cpu | cuda | cuda:N: where a model drafter runs [SPECDEC_DEVICE]")
    p.add_argument("--quant", default=_env("SPECDEC_DRAFT_QUANT", "none"), choices=QUANT_MODES,
                   help="quantized linears for the draft model (layer-skip: the target's layers it "
                        "keeps) [SPECDEC_DRAFT_QUANT]")
    add_draft_vocab_arg(p)
    add_draft_min_conf_arg(p)
    p.add_argument("--kv-tokens", type=int, default=int(_env("SPECDEC_KV_TOKENS", 16384)),
                   help="draft KV pool in tokens; idle sessions are evicted (LRU) when full [SPECDEC_KV_TOKENS]")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   default=_env_flag("SPECDEC_BATCH_INVARIANT", True),
                   help="model drafters: a session's drafts do not depend on the other sessions in the forward "
                        "(default on; off: a little faster) [SPECDEC_BATCH_INVARIANT]")
    p.add_argument("--max-message-mb", type=int, default=int(_env("SPECDEC_MAX_MESSAGE_MB", 64)),
                   help="gRPC send/receive message limit [SPECDEC_MAX_MESSAGE_MB]")
    p.add_argument("--threads", type=int, default=int(_env("SPECDEC_THREADS", 0)),
                   help="torch threads (0 = torch's default) [SPECDEC_THREADS]")
    p.add_argument("--auth-token", default=_env("SPECDEC_DRAFT_TOKEN", None) or None,
                   help="shared secret: Drafter calls need metadata 'authorization: Bearer <token>' (health stays "
                        "open); prefer the env var, flags show in ps [SPECDEC_DRAFT_TOKEN]")
    p.add_argument("--tls-cert", default=_env("SPECDEC_DRAFT_TLS_CERT", None) or None,
                   help="PEM certificate (chain): serve TLS only [SPECDEC_DRAFT_TLS_CERT]")
    p.add_argument("--tls-key", default=_env("SPECDEC_DRAFT_TLS_KEY", None) or None,
                   help="PEM private key of --tls-cert [SPECDEC_DRAFT_TLS_KEY]")
    args = p.parse_args(argv)
    if not 0 <= args.port < 65536:
        p.error(f"--port {args.port} is out of range")
    if args.kv_tokens < 1 or args.max_message_mb < 1 or args.threads < 0:
        p.error("--kv-tokens and --max-message-mb must be positive, --threads non-negative")
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    for f in (args.tls_cert, args.tls_key):
        if f is not None and not os.path.isfile(f):
            p.error(f"{f}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=os.environ.get("SPECDEC_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    try:
        asyncio.run(serve(args))
    except SpecdecError as e:        # bad model/dtype/layers, address in use: one line, no traceback
        print(f"draft server: {e}", file=sys.stderr)
        return 2
    return 0
