"""python -m target_service — the verify server: REST (OpenAI-compatible) and gRPC on their own ports.

Every flag has an environment fallback (SPECDEC_*), so the same image runs from flags or env (compose, k8s).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

log = logging.getLogger("specdec.target")
BACKEND_DEAD_LINGER_S = 2.0


def lookup_names(value: str) -> list[str]:
    """--lookup's value as lookup drafters' names: '' / '0' none, '1' ngram (the flag's old meaning), else a list."""
    from specdec.draft import LOOKUPS
    value = value.strip()
    names = [] if value in ("", "0") else ["ngram"] if value == "1" else value.replace("+", ",").split(",")
    bad = [n for n in names if n not in LOOKUPS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(LOOKUPS)}")
    return names


def env(name: str, default=None):
    return os.environ.get(f"SPECDEC_{name}", default)


def env_flag(name: str, default: bool) -> bool:
    """A boolean SPECDEC_* variable: 0/false/no/off is False, any other value True, unset or empty the default."""
    v = env(name, "").strip().lower()
    return default if not v else v not in ("0", "false", "no", "off")


def parser() -> argparse.ArgumentParser:
    from specdec.engine.quant import MODES as QUANT_MODES
    ap = argparse.ArgumentParser(prog="target_service", description=__doc__)
    ap.add_argument("--host", default=env("HOST", "127.0.0.1"), help="bind address for REST and gRPC")
    ap.add_argument("--port", type=int, default=int(env("PORT", 8000)), help="REST port")
    ap.add_argument("--grpc-port", type=int, default=int(env("GRPC_PORT", 50051)), help="gRPC port (0 = off)")
    ap.add_argument("--model", default=env("MODEL", "smollm2-135m"), help="target model preset or path")
    ap.add_argument("--dtype", default=env("DTYPE"), help="bf16 | fp32 | fp64 (default: bf16; fp64 for tiny-*)")
    ap.add_argument("--kv-tokens", type=int, default=int(env("KV_TOKENS", 32768)))
    ap.add_argument("--quant", default=env("QUANT", "none"), choices=QUANT_MODES,
                    help="quantized linears (engine/quant.py), cached like the converted weights "
                         "[SPECDEC_QUANT]")
    ap.add_argument("--tp", type=int, default=int(env("TP", 1)),
                    help="tensor-parallel ranks: this process is rank 0 and starts ranks 1..N-1 [SPECDEC_TP]")
    ap.add_argument("--backend", default=env("BACKEND", "embedded"), choices=["embedded", "sglang"],
                    help="embedded: this process runs --model; sglang: an SGLang server at --sglang-url runs it (one "
                         "batched top-K scoring call per step; --model gives the tokenizer and config) [SPECDEC_BACKEND]")
    ap.add_argument("--sglang-url", default=env("SGLANG_URL", ""),
                    help="the SGLang server for --backend sglang, e.g. http://sglang:30000 [SPECDEC_SGLANG_URL]")
    ap.add_argument("--sglang-top-k", type=int, default=int(env("SGLANG_TOP_K", 20)),
                    help="log-probabilities asked per row; rows the top-K does not certify are asked again with more")
    ap.add_argument("--sglang-timeout-s", type=float, default=float(env("SGLANG_TIMEOUT_S", 60)))
    ap.add_argument("--device", default=env("DEVICE", "cpu"),
                    help="cpu | cuda | cuda:N (with --tp, rank r runs on cuda:N+r) [SPECDEC_DEVICE]")
    ap.add_argument("--draft", default=env("DRAFT_ADDR", ""),
                    help="draft server host:port; 'ngram' drafts in process; empty = no speculation")
    ap.add_argument("--draft-name", default=env("DRAFT_NAME", ""), help="the draft model's name, for the records")
    ap.add_argument("--lookup", nargs="?", type=lookup_names, const=["ngram"], default=env("LOOKUP", ""),
                    help="drafters that copy, run in this process, the draft server asked only where they find "
                         "nothing (no round trip for a copied block): ngram (prompt lookup in the context; also "
                         "bare --lookup or 1), corpus (the target's own past text, shipped beside its block drafter), "
                         "or ngram,corpus (tried in that order); empty or 0: none [SPECDEC_LOOKUP]")
    ap.add_argument("--draft-deadline-ms", type=float, default=float(env("DRAFT_DEADLINE_MS", 1000)))
    ap.add_argument("--draft-token", default=env("DRAFT_TOKEN") or None,
                    help="shared secret sent to the draft server (its --auth-token); prefer the env var")
    ap.add_argument("--draft-tls-ca", default=env("DRAFT_TLS_CA") or None,
                    help="PEM CA certificate: talk TLS to the draft server, trusting this CA")
    ap.add_argument("--gamma", type=int, default=int(env("GAMMA", 4)))
    ap.add_argument("--acceptance", default=env("ACCEPTANCE", "coupled"), choices=["rejection", "coupled"],
                    help="default acceptance for sampled requests: coupled (output = plain seeded decoding, whatever "
                         "the drafter) or rejection (a few %% more accepted drafts; its seeded text depends on the "
                         "proposals, gamma and draft outages)")
    ap.add_argument("--verify", default=env("VERIFY", "compact"), choices=["compact", "padded"])
    ap.add_argument("--tree-rows", type=int, default=env("TREE_ROWS"),
                    help="verify-tree leaves: at most this many rows a step adds beside the chains, alternatives to "
                         "the first draft slots where the planner finds they pay (greedy and coupled requests; "
                         "0: chains only; default speculative/tree.py's TREE_ROWS)")
    ap.add_argument("--planner", default=env("PLANNER", "cost"), choices=["cost", "full"],
                    help="cost: verify per request what pays, from the drafter's confidences (calibrated online) and "
                         "the verify cost profiled at start-up, with adaptive gamma (greedy and coupled requests; "
                         "rejection requests verify every draft); full: verify every draft")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                    default=env_flag("BATCH_INVARIANT", True),
                    help="a row's logits do not depend on the rest of the forward, so seeded output is exactly "
                         "reproducible whatever the batch (default on; off: a little faster) [SPECDEC_BATCH_INVARIANT]")
    ap.add_argument("--max-running", type=int, default=int(env("MAX_RUNNING", 32)),
                    help="requests in the running batch; the rest queue (default 32) [SPECDEC_MAX_RUNNING]")
    ap.add_argument("--max-queue", type=int, default=int(env("MAX_QUEUE", 64)))
    ap.add_argument("--redis-url", default=env("REDIS_URL", ""), help="empty: the embedded in-memory store")
    ap.add_argument("--redis-namespace", default=env("REDIS_NAMESPACE", "specdec"))
    ap.add_argument("--state-ttl-s", type=int, default=int(env("STATE_TTL_S", 86400)))
    ap.add_argument("--instance-id", default=env("INSTANCE_ID"))
    ap.add_argument("--api-keys", default=env("API_KEYS", ""), help="comma-separated; empty = no auth")
    ap.add_argument("--max-body-mb", type=float, default=float(env("MAX_BODY_MB", 16)),
                    help="REST request body limit (413 above it)")
    ap.add_argument("--trace", default=env("TRACE"), help="JSONL trace file (one record per request per step)")
    ap.add_argument("--threads", type=int, default=int(env("THREADS", 0)), help="torch threads (0 = default)")
    ap.add_argument("--log-level", default=env("LOG_LEVEL", "info"))
    ap.add_argument("--request-timeout-s", type=float, default=float(env("REQUEST_TIMEOUT_S", 600)),
                    help="default deadline of a request, queue + generation (REST timeout_s overrides); 0 = none")
    ap.add_argument("--fault-step-delay-ms", type=float, default=float(env("FAULT_STEP_DELAY_MS", 0)),
                    help="fault injection for tests: sleep this long after every step")
    return ap


async def serve(args) -> int:
    import torch

    from specdec import compute
    from specdec.engine.backend import open_backend

    compute.keep_freed_memory()
    # Every torch call of this process runs on one thread (specdec/compute.py: OpenMP is slow across threads).
    if args.threads:
        await compute.run(torch.set_num_threads, args.threads)
    if args.backend == "sglang":
        from specdec.engine.sglang_backend import open_sglang_for_server
        lm = await compute.run(open_sglang_for_server, args)
    else:
        lm = await compute.run(open_backend, args.model, tp=args.tp, dtype=args.dtype, device=args.device,
                               kv_tokens=args.kv_tokens, batch_invariant=args.batch_invariant, quant=args.quant)
    engine = lm.backend
    try:
        return await _serve(args, lm, engine)
    finally:
        engine.close()


def build_drafter(args, lm, engine):
    """The target's drafter chain and its name for the records: none, in-process n-gram, or the draft server (a
    RemoteDrafter) behind --lookup's copying drafters. Call it on the compute thread (its torch work stays there)."""
    from .draft_client import RemoteDrafter

    drafter, draft_name = None, args.draft_name or args.draft or "none"
    if args.draft == "ngram":
        from specdec.draft.ngram import NgramDrafter
        drafter = NgramDrafter()
    elif args.draft:
        drafter = RemoteDrafter(args.draft, engine.vocab_size, deadline_s=args.draft_deadline_ms / 1000,
                                token=args.draft_token, tls_ca=args.draft_tls_ca,
                                target_model=getattr(lm, "model", None))   # hidden states for a block drafter
        if args.lookup:
            from specdec.draft import lookup_drafter
            from specdec.draft.hybrid import HybridDrafter
            drafter = HybridDrafter(drafter, lookups=[lookup_drafter(n, getattr(lm, "model", None))
                                                      for n in args.lookup])
            draft_name = "+".join([draft_name, *args.lookup])
    return drafter, draft_name


WARM_UP_RETRY_S = 1.0


async def _warm_up_when_answered(drafter, vocab_size: int) -> None:
    """The warm-up again, until the draft server answers (it may come up after the target: `make run`'s block draft
    server takes ~45 s to load and warm up, the target ~15). A block drafter's first answer names the layers the
    target must send, and the target taps them from then on: a batch prefilled before that had every prompt recomputed
    for its first Propose (served chat at 32 requests: 770 rows, 0.85 s of the benchmark's first drafting steps).
    While the draft server is down the client's circuit breaker refuses most tries at once, without a call."""
    from specdec import compute
    from specdec.draft import warm_up
    tries = 0
    while True:
        await asyncio.sleep(WARM_UP_RETRY_S)
        tries += 1
        ms = await compute.run(warm_up, drafter, vocab_size)
        if ms is not None:
            log.info("drafter warm-up: %.0f ms (try %d, the draft server answering)", ms, tries + 1)
            return


async def _serve(args, lm, engine) -> int:
    import uvicorn

    from specdec import compute
    from specdec.speculative.generator import TraceWriter
    from specdec.state import open_store

    from .grpc_server import build_grpc_server, set_health
    from .metrics import Metrics
    from .rest import create_app
    from .scheduler import Scheduler, SchedulerConfig
    from .service import TargetService

    # built on the compute thread, like the draft server's drafter: the corpus's table is sorted by torch, and a
    # parallel region entered from this thread would give it an OpenMP team of its own, which slows every step after
    # it (compute.py)
    drafter, draft_name = await compute.run(build_drafter, args, lm, engine)
    warming = None
    if drafter is not None:
        from specdec.draft import warm_up
        ms = await compute.run(warm_up, drafter, engine.vocab_size)
        log.info("drafter warm-up: %s", "failed (draft server not answering yet; retried every "
                 f"{WARM_UP_RETRY_S:g} s while serving)" if ms is None else f"{ms:.0f} ms")
        if ms is None:
            warming = asyncio.create_task(_warm_up_when_answered(drafter, engine.vocab_size), name="warm-up")
    store = open_store(args.redis_url or None, namespace=args.redis_namespace, ttl_s=args.state_ttl_s)
    metrics = Metrics(lm.name)
    metrics.store_round_trips.set_function(lambda: getattr(store, "round_trips", 0))
    metrics.feature_rows_recomputed.set_function(
        lambda: getattr(getattr(drafter, "features", None), "recomputed", 0))
    trace = TraceWriter(open(args.trace, "a", buffering=1)) if args.trace else None
    from specdec.speculative.tree import TREE_ROWS
    cfg = SchedulerConfig(max_running=args.max_running, max_queue=args.max_queue, layout=args.verify,
                          tree_rows=TREE_ROWS if args.tree_rows is None else int(args.tree_rows),
                          step_delay_s=args.fault_step_delay_ms / 1000, request_timeout_s=args.request_timeout_s)
    if args.instance_id:
        cfg.instance_id = args.instance_id
    planner = None
    if drafter is not None and args.planner == "cost":
        from specdec.engine.engine import Engine
        from specdec.speculative.plan import ServicePlanner, profile_cost
        if isinstance(engine, Engine):      # the cost table is profiled on the engine (a few forwards)
            planner = ServicePlanner(await compute.run(profile_cost, engine))
            metrics.catch_ups_withheld.set_function(lambda: planner.catch_ups_withheld)
            log.info("verify cost profile (rows: ms): %s",
                     ", ".join(f"{n}: {ms:.1f}" for n, ms in zip(planner.cost.rows, planner.cost.ms)))
    sched = Scheduler(engine, drafter, store, lm.tokenizer, cfg, metrics, trace, planner=planner)
    svc = TargetService(engine, sched, store, lm.tokenizer, model_name=lm.name, draft_name=draft_name,
                        gamma=args.gamma, mode=args.acceptance, metrics=metrics,
                        **({"caps": engine.caps} if hasattr(engine, "caps") else {}))   # what this backend honours
    if args.backend == "sglang":
        from specdec.engine.sglang_backend import register_metrics
        register_metrics(metrics.registry, engine)
    keys = frozenset(k for k in args.api_keys.split(",") if k)
    app = create_app(svc, metrics, keys, max_body_bytes=int(args.max_body_mb * (1 << 20)))
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           access_log=False, lifespan="off"))
    server.install_signal_handlers = lambda: None   # we handle SIGTERM/SIGINT below, for both servers
    grpc_server = health = None
    if args.grpc_port:
        grpc_server, gport, health = build_grpc_server(svc, args.host, args.grpc_port, api_keys=keys)
        await grpc_server.start()
        await set_health(health, True)
    sched.start()
    # The backend can go down as a whole (a tensor-parallel rank died or hung): the scheduler ends every request with a
    # retryable error (their committed tokens are in the store), then we stop, exiting non-zero for a restart.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    exit_code = 0

    def backend_dead(reason: str) -> None:
        nonlocal exit_code
        log.error("model backend down (%s): shutting down for a restart in %.0f s", reason, BACKEND_DEAD_LINGER_S)
        exit_code = 3
        server.config.timeout_graceful_shutdown = 1    # the error events are out; do not wait on idle clients
        # /health answers 503 meanwhile, so a supervisor's or load balancer's probe sees why before the port closes
        loop.call_later(BACKEND_DEAD_LINGER_S, stop.set)
    sched.on_backend_dead = backend_dead
    if hasattr(engine, "on_dead"):
        engine.on_dead.append(sched.backend_lost)    # from its watch thread: the streams end now, not after the step
    tp = f", TP{args.tp}" if args.tp > 1 else ""
    print(f"target server: {lm.name} ({engine.dtype}{tp}) REST http://{args.host}:{args.port} "
          f"gRPC {args.host}:{args.grpc_port or 'off'}; draft {draft_name}; state store "
          f"{'redis ' + args.redis_url if args.redis_url else 'in-memory (embedded; no Redis URL set)'}", flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("start-up objects frozen: %d", compute.settle_heap())
    rest_task = asyncio.create_task(server.serve())
    await stop.wait()
    t_stop = time.monotonic()
    if health:
        await set_health(health, False)
    server.should_exit = True
    if grpc_server:
        await grpc_server.stop(grace=1 if exit_code else 5)
    await rest_task
    if warming is not None:
        warming.cancel()
    await sched.stop()
    await store.close()
    if trace:
        trace.f.close()
    log.info("stopped in %.2f s", time.monotonic() - t_stop)
    return exit_code


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from specdec.errors import SpecdecError
    try:
        rc = asyncio.run(serve(args))
        if rc:
            # The backend died and a supervisor waits to restart us: everything is closed and flushed, so skip the
            # interpreter's teardown of torch (seconds on a busy machine).
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
        return rc
    except SpecdecError as e:
        print(f"target_service: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
