"""Continuous batching on the target: admission queue -> running batch -> one speculative step -> commit -> stream.

One asyncio task owns the engine. Each iteration admits waiting requests while the running batch and the KV budget
allow (validation and the state-store record happen before a request ever reaches the queue; one admitted while
others run is prefilled inside the next step's forward, apart otherwise), runs one
`speculative_step` over the whole running batch in a worker thread, commits every request's new tokens to the store
in one round trip (compare-and-set on committed length, fenced by epoch), and only then streams them.

A commit the store refuses (another owner took the request) ends that request with an error. A store that is down
leaves the step's commit *in doubt* (the script may have run before the connection broke): the step is kept, nothing
is streamed, and the same commit is retried with backoff until the store answers; a retry the store refuses is then
reconciled against the stored record (our epoch and exactly our tokens = it had landed). So every token is committed
once and streamed once, and a client sees only committed tokens.

Every request has a deadline (its `timeout_s`, else the server's `request_timeout_s`): past it the request leaves the
queue or the batch at the next step boundary with finish_reason "timeout", its KV and draft session freed.

Fault isolation: a step that raises is undone (outputs, stats, KV back to the step's start) and rerun for the same
batch as plain decoding (no drafts): for greedy and coupled requests exactly the tokens the step would have emitted
(plain decoding defines their output); rejection-mode text depends on the step structure anyway, as after a draft
outage. `specdec:step_retries_total` counts it. If that raises too, each request is stepped alone, and only those that still cannot proceed end, with a
retryable error (REST 503, gRPC UNAVAILABLE): their committed tokens stay in the store (status "running"), so a
resume by id continues them exactly. Their neighbours go on as if nothing happened.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import time
import uuid

from specdec import compute
from specdec.engine.backend import Backend, TopKBackend
from specdec.engine.layout import SeqInput
from specdec.errors import BackendDead
from specdec.engine.tokenizer import StreamDecoder
from specdec.speculative.propose import Drafter
from specdec.speculative.step import SpecRequest, StepInfo, plan_full, speculative_step
from specdec.state import Commit, RequestRecord, StateStore, StoreUnavailable

log = logging.getLogger("specdec.scheduler")


class QueueFull(Exception):
    pass


@dataclasses.dataclass
class Event:
    tokens: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    retryable: bool = False          # with error: the request can be resumed by id (REST 503, gRPC UNAVAILABLE)


@dataclasses.dataclass
class Job:
    req: SpecRequest
    record: RequestRecord
    stop: tuple[str, ...] = ()
    events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
    detok: StreamDecoder | None = None
    text: str = ""                   # text of the whole output so far (for stop strings)
    sent_chars: int = 0
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    cancelled: bool = False
    resumed_tokens: int = 0          # output tokens that were committed before this (re)start
    timeout_s: float | None = None   # per-request limit; None: the scheduler's request_timeout_s
    deadline: float | None = None    # perf_counter time past which the request ends with finish_reason "timeout"
    timed_out: bool = False

    @property
    def rid(self) -> str:
        return self.req.rid


@dataclasses.dataclass
class SchedulerConfig:
    # 32: served chat at 32 concurrent requests, plain decoding gave 369 tok/s at a batch of 32 against 322 at 16 (the
    # other 16 queued); a request's steps slow down (inter-token 56 ms against 36) but it queues less
    max_running: int = 32
    max_queue: int = 64
    layout: str = "compact"
    tree_rows: int = 0               # verify-tree leaf rows a step may add (speculative/tree.py)
    step_delay_s: float = 0.0        # fault injection (tests): a slow target
    request_timeout_s: float = 600.0  # default per-request deadline (queue + generation); 0 = none
    store_retry_s: tuple[float, float] = (0.1, 1.0)   # backoff (first, max) while the state store is down
    # Requests admitted while others run are prefilled inside the next step's forward, up to this many context rows
    # (0: each admission prefills in a forward of its own, which streams every weight again for a few rows: served
    # chat at 32 concurrent requests, ~55 ms for one prompt against ~27 ms a prompt in a batch of 15)
    mix_prefill_rows: int = 256
    instance_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])


@dataclasses.dataclass
class _Pending:
    """A step whose commit the store has not acknowledged yet: the jobs, their commits, the step's info."""
    jobs: list[Job]
    commits: list[Commit]
    info: StepInfo
    step_s: float
    pre_len: list[int]               # per job: committed length before the step
    in_doubt: bool = False           # a commit attempt failed with the outcome unknown
    attempts: int = 0

    def drop(self, job: Job) -> None:
        k = self.jobs.index(job)
        for lst in (self.jobs, self.commits, self.pre_len, self.info.verify_len, self.info.accepted,
                    self.info.emitted):
            del lst[k]


@dataclasses.dataclass
class _Snapshot:
    """What a step changes in a request, taken before it, so a failed step can be undone."""
    output_len: int
    draft_seen: int
    finish_reason: str | None
    stats: object

    @classmethod
    def take(cls, r: SpecRequest) -> "_Snapshot":
        return cls(len(r.output), r.draft_seen, r.finish_reason, copy.deepcopy(r.stats))

    def restore(self, r: SpecRequest) -> None:
        del r.output[self.output_len:]
        r.draft_seen, r.finish_reason, r.stats = self.draft_seen, self.finish_reason, copy.deepcopy(self.stats)


def _merge(infos: list[StepInfo]) -> StepInfo:
    """The requests' one-request steps as one step (in order)."""
    return StepInfo(sum(i.rows for i in infos), [v for i in infos for v in i.verify_len],
                    [a for i in infos for a in i.accepted], [e for i in infos for e in i.emitted],
                    all(i.draft_ok for i in infos), sum(i.draft_ms for i in infos), sum(i.verify_ms for i in infos),
                    sum(i.accept_ms for i in infos))


class Scheduler:
    def __init__(self, engine: Backend, drafter: Drafter | None, store: StateStore, tokenizer,
                 cfg: SchedulerConfig = SchedulerConfig(), metrics=None, trace=None, planner=None):
        """planner: verify_len per request (speculative/plan.py's ServicePlanner); None verifies every draft."""
        self.engine, self.drafter, self.store, self.tok = engine, drafter, store, tokenizer
        self.planner = planner or plan_full
        self.cfg, self.metrics, self.trace = cfg, metrics, trace
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.engine_lock = asyncio.Lock()          # the engine is not re-entrant: steps, prefills, Verify calls
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._pending: _Pending | None = None
        self._mix: list[Job] = []                  # admitted, in `running`, prefilled by the next step's forward
        self._background: set[asyncio.Task] = set()   # fire-and-forget store writes (held so they are not collected)
        self.steps = 0
        self.on_backend_dead = None                # called once (with the reason) when the backend cannot run
        self.backend_dead: str | None = None
        self._lost = asyncio.Event()               # the backend's own watch declared it down (backend_lost)
        self._lost_reason = ""
        self._gauges()

    # -- admission --------------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        self.check_capacity()
        job.detok = StreamDecoder(self.tok)
        limit = job.timeout_s if job.timeout_s is not None else self.cfg.request_timeout_s
        if limit and job.deadline is None:
            job.deadline = job.submitted + limit
        if job.req.output:  # resumed: the text of what was already committed
            job.detok.push(job.req.output)
            job.text = self.tok.decode(job.req.output)
            job.sent_chars = len(job.text)
        self.waiting.append(job)
        self._wake.set()
        self._gauges()
        return job

    def check_capacity(self) -> None:
        """Raise QueueFull (or BackendDead) now if `submit` would (callers check before writing any state)."""
        if self.backend_dead or not self.engine.healthy():
            raise BackendDead(f"the model backend of this server is down ({self.backend_dead or 'restarting'})")
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are queued (limit {self.cfg.max_queue})")

    def cancel(self, job: Job) -> None:
        """Client gone: the job leaves the batch at the next step boundary; KV and draft session are freed."""
        job.cancelled = True
        self._wake.set()

    def _kv_need(self, r: SpecRequest) -> int:
        return len(r.prompt) + r.max_tokens + r.gamma + 1

    def _kv_budget_left(self) -> int:
        used = sum(self._kv_need(j.req) for j in self.running)
        return self.engine.kv_capacity_tokens - used - self.engine.kv_page_size * len(self.running)

    async def _admit(self) -> None:
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.cfg.max_running:
            job = self.waiting[0]
            if job.cancelled:
                self.waiting.pop(0)
                continue
            if self._kv_need(job.req) > self._kv_budget_left() - sum(self._kv_need(j.req) for j in admitted):
                break  # wait for running requests to free KV
            admitted.append(self.waiting.pop(0))
        if not admitted:
            return
        if self.running and self._pending is None and not isinstance(self.engine, TopKBackend) \
                and sum(j.req.committed_len - 1 for j in admitted) <= self.cfg.mix_prefill_rows:
            self._mix += admitted              # their first step is the one after the next
            self.running += admitted
            self._gauges()
            return
        try:
            async with self.engine_lock:
                await self.run_engine(self._prefill, admitted)
        except BackendDead:
            self.running += admitted           # so _backend_down ends them with the others
            raise
        self.running += admitted
        self._gauges()

    def _contexts(self, jobs: list[Job]) -> list[tuple[int, list[int]]]:
        """(sequence, context) of each job with one: every committed token but the anchor (prompt, plus the output of
        a resumed request)."""
        return [(j.req.seq, j.req.committed[:-1]) for j in jobs if j.req.committed_len > 1]

    def _prefill(self, jobs: list[Job]) -> None:
        """New sequences for `jobs`, their contexts prefilled in forwards of their own."""
        for j in jobs:
            j.req.seq = self.engine.new_sequence()
        self._prefill_seqs(jobs)

    def _prefill_seqs(self, jobs: list[Job]) -> None:
        pre = self._contexts(jobs)
        if pre:
            self.engine.prefill([s for s, _ in pre], [c for _, c in pre])

    def _mix_inputs(self, jobs: list[Job]) -> list[SeqInput]:
        """New sequences for `jobs` and their context rows, to pack into a step's forward."""
        for j in jobs:
            j.req.seq = self.engine.new_sequence()
        return [SeqInput(s, c, start=0, logits="none") for s, c in self._contexts(jobs)]

    # -- the loop ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        while True:
            try:
                if self._lost.is_set() or not self.engine.healthy():
                    raise BackendDead(self._lost_reason or "the model backend is down")
                await self._reap()
                await self._admit()
                if not self.running:
                    self._wake.clear()
                    if not self.waiting:
                        await self._wake.wait()
                    else:
                        await asyncio.sleep(0.01)
                    continue
                await self._step()
            except asyncio.CancelledError:
                raise
            except BackendDead as e:
                await self._backend_down(str(e))
                return
            except Exception:  # noqa: BLE001 - a bug in one step must not kill the server; fail the batch loudly
                log.exception("scheduler step failed; failing the running requests")
                failed, self.running, self._pending = self.running, [], None
                for j in failed:
                    j.events.put_nowait(Event([], "", error="internal error during generation"))
                await self._release(failed)

    async def _step(self) -> None:
        if self._pending is not None:          # the store was down: finish that step before running another
            await self._commit(self._pending)
            return
        t_start = time.perf_counter()
        mix, self._mix = self._mix, []
        mixed = {id(j) for j in mix}           # by identity: a Job is a dataclass, `in` would compare its fields
        batch = [j for j in self.running if id(j) not in mixed]
        if not batch:                          # nothing to step with: prefill them apart
            async with self.engine_lock:
                await self.run_engine(self._prefill, mix)
            return
        before = [len(j.req.output) for j in batch]
        if hasattr(self.planner, "closed"):    # nothing waits: the batch only shrinks (CostPlanner.burst_worth)
            self.planner.closed = not self.waiting
        async with self.engine_lock:
            info, failed, retried = await self.run_engine(self._isolated_step, [j.req for j in batch], mix)
        self.steps += 1
        if retried and self.metrics:
            self.metrics.step_retries.labels(**self.metrics.labels).inc()
        if failed:
            await self._fail([batch[k] for k in failed])
            batch = [j for k, j in enumerate(batch) if k not in failed]
            before = [n for k, n in enumerate(before) if k not in failed]
            if not batch:
                return
        if self.cfg.step_delay_s:
            await asyncio.sleep(self.cfg.step_delay_s)
        for j in batch:  # a stop string ends the request: decide it before the commit, so the record says so
            if j.stop and not j.req.finish_reason and any(x in self.tok.decode(j.req.output) for x in j.stop):
                j.req.finish_reason = "stop"
        commits = [Commit(j.rid, j.record.epoch, len(j.req.prompt) + n0, toks,
                          status="finished" if j.req.finish_reason else None, finish_reason=j.req.finish_reason,
                          stats=dataclasses.asdict(j.req.stats) if j.req.finish_reason else None)
                   for j, n0, toks in zip(batch, before, info.emitted)]
        await self._commit(_Pending(batch, commits, info, time.perf_counter() - t_start,
                                    [len(j.req.prompt) + n0 for j, n0 in zip(batch, before)]))

    # -- fault isolation --------------------------------------------------------------------------------------------
    def _isolated_step(self, reqs: list[SpecRequest], mix: list[Job] = ()) -> tuple[StepInfo, list[int], bool]:
        """One step for `reqs` (worker thread, engine lock held) that a fault in one request cannot turn into a
        failure of all: returns (the step's info for the requests that stepped, indices of those that could not,
        whether the step had to be rerun). `mix`: admitted jobs whose context this step's forward prefills (a rerun
        writes it again; the last resort prefills it apart)."""
        snaps = [_Snapshot.take(r) for r in reqs]
        pre = self._mix_inputs(list(mix))
        try:
            info = speculative_step(self.engine, self.drafter, reqs, layout=self.cfg.layout, plan=self.planner,
                                    prefill=pre, tree_rows=self.cfg.tree_rows)
            return info, [], False
        except BackendDead:        # no rerun can help: the whole backend is gone
            self._undo(reqs, snaps)
            raise
        except Exception:  # noqa: BLE001 - whatever broke (a drafter's answer, a bug), plain decoding is the fallback
            log.exception("speculative step failed (%d requests); rerunning it as plain decoding", len(reqs))
        self._undo(reqs, snaps)
        try:
            return self._plain_step(reqs, pre), [], True
        except BackendDead:
            self._undo(reqs, snaps)
            raise
        except Exception:  # noqa: BLE001
            log.exception("plain-decoding rerun failed too; stepping each of the %d requests alone", len(reqs))
        self._undo(reqs, snaps)
        self._prefill_seqs(list(mix))
        infos, failed = [], []
        for k, (r, snap) in enumerate(zip(reqs, snaps)):
            try:
                infos.append(self._plain_step([r]))
            except BackendDead:
                self._undo(reqs, snaps)            # nothing of this step is committed
                raise
            except Exception:  # noqa: BLE001
                log.exception("request %s cannot proceed; ending it with a retryable error", r.rid)
                self._undo([r], [snap])
                failed.append(k)
        return _merge(infos), failed, True

    def _plain_step(self, reqs: list[SpecRequest], prefill: list[SeqInput] = ()) -> StepInfo:
        """A step without drafts: exactly plain decoding (greedy / coupled output unchanged by the rerun)."""
        info = speculative_step(self.engine, None, reqs, layout=self.cfg.layout, plan=plan_full, prefill=prefill)
        info.draft_ok = False                  # counted as a fallback step, like a drafter outage
        for r in reqs:
            r.stats.fallback_steps += 1
        return info

    def _undo(self, reqs: list[SpecRequest], snaps: list["_Snapshot"]) -> None:
        """Back to the step's start: outputs, stats, draft bookkeeping, and KV = every committed token but the
        anchor (a step only writes from the anchor on, so truncating is enough)."""
        for r, snap in zip(reqs, snaps):
            snap.restore(r)
            try:
                if r.seq >= 0 and self.engine.has_sequence(r.seq):
                    self.engine.truncate(r.seq, min(self.engine.length(r.seq), r.committed_len - 1))
            except Exception:  # noqa: BLE001 - its next step will show whether it can proceed
                log.exception("could not roll back the KV of %s", r.rid)

    async def _fail(self, jobs: list[Job]) -> None:
        """End requests no step could run, with a retryable error. Their record is left as it is (status "running",
        the committed tokens), so a resume by id continues them with identical output."""
        self.running = [j for j in self.running if j not in jobs]
        for j in jobs:
            j.req.finish_reason = "error"
            j.events.put_nowait(Event([], "", error=f"generation of request {j.rid} failed on this server; its "
                                      f"committed tokens are kept: retry with resume=true and request_id={j.rid}",
                                      retryable=True))
            if self.metrics:
                self.metrics.requests.labels(finished_reason="error", **self.metrics.labels).inc()
                self.metrics.step_failed_requests.labels(**self.metrics.labels).inc()
        await self._release(jobs)
        self._gauges()

    async def _backend_down(self, reason: str) -> None:
        """The backend cannot run any more (a tensor-parallel rank died or hung): the step in flight was undone, every
        earlier step is committed, so each request ends with a retryable error and resumes by id elsewhere or after a
        restart. The scheduler stops here; `on_backend_dead` tells the server to go (503, exit non-zero)."""
        log.error("model backend down (%s): ending %d running and %d queued requests with a retryable error",
                  reason, len(self.running), len(self.waiting))
        self.backend_dead = reason
        if self._pending is not None:          # a commit held by a store outage: one last try
            try:
                await self.store.commit(self._pending.commits)
            except Exception:  # noqa: BLE001 - the store keeps what it has; resume reconciles by committed length
                pass
            self._pending = None
        jobs, self.running, self.waiting = self.running + self.waiting, [], []
        for j in jobs:
            j.req.finish_reason = "error"
            j.events.put_nowait(Event([], "", error=f"the model backend of this server is down ({reason}); the "
                                      f"committed tokens of request {j.rid} are kept: retry with resume=true and "
                                      f"request_id={j.rid}", retryable=True))
            if self.metrics:
                self.metrics.requests.labels(finished_reason="error", **self.metrics.labels).inc()
        await self._release(jobs)
        self._gauges()
        if self.on_backend_dead:
            self.on_backend_dead(reason)

    def backend_lost(self, reason: str) -> None:
        """Thread-safe, from a backend's watch (a tensor-parallel rank died): the backend is down whatever the call
        in flight does. A collective that the dead rank left waiting may not return for a long time, so the loop
        stops waiting for it (run_engine) and ends every request now instead of after it."""
        loop = self._task.get_loop() if self._task else None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._mark_lost, reason)

    def _mark_lost(self, reason: str) -> None:
        self._lost_reason = self._lost_reason or reason
        self._lost.set()
        self._wake.set()

    async def run_engine(self, fn, *args):
        """compute.run(fn, *args), abandoned with BackendDead once the backend is declared lost meanwhile. The
        abandoned call goes on in the compute thread; nothing it returns is committed or streamed."""
        if self._lost.is_set():
            raise BackendDead(self._lost_reason)
        work = asyncio.ensure_future(compute.run(fn, *args))
        lost = asyncio.ensure_future(self._lost.wait())
        try:
            await asyncio.wait({work, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if work.done():
            return work.result()
        work.add_done_callback(lambda f: f.cancelled() or f.exception())   # retrieved: no "never retrieved" log
        raise BackendDead(self._lost_reason)

    async def _commit(self, p: _Pending) -> None:
        """Commit a step, then stream it. Store down: keep the step pending (retried next iteration, after a
        backoff); nothing is streamed until the store has the tokens."""
        t_commit = time.perf_counter()
        try:
            ok = await self.store.commit(p.commits)
            if p.in_doubt and not all(ok):
                ok = await self._reconcile(p, ok)
        except StoreUnavailable as e:
            if not p.in_doubt:
                log.warning("state store unavailable (%s): holding the step's commit, retrying", e)
            p.in_doubt, p.attempts = True, p.attempts + 1
            self._pending = p
            if self.metrics and hasattr(self.metrics, "store_errors"):
                self.metrics.store_errors.labels(**self.metrics.labels).inc()
            first, most = self.cfg.store_retry_s
            await asyncio.sleep(min(most, first * 2 ** (p.attempts - 1)))
            return
        if p.in_doubt:
            log.warning("state store back: step committed after %d failed attempts", p.attempts)
        self._pending = None
        batch, info = p.jobs, p.info
        now = time.perf_counter()
        if self.metrics:
            self.metrics.observe_step(batch, info, p.step_s + (now - t_commit))
        if self.trace:
            self.trace.write([j.req for j in batch], info, commit_ms=(now - t_commit) * 1e3)
        for j, good, toks in zip(batch, ok, info.emitted):
            if not good:
                j.events.put_nowait(Event([], "", error="request is owned by another target instance"))
                j.req.finish_reason = "error"
                continue
            self._stream(j, toks, now)
        done = [j for j in batch if j.req.finish_reason]
        self.running = [j for j in self.running if not j.req.finish_reason]
        await self._release(done)
        self._gauges()

    async def _reconcile(self, p: _Pending, ok: list[bool]) -> list[bool]:
        """A retried commit was refused: did the first attempt land? It did iff the record is still ours (same epoch)
        and holds exactly this step's output. Otherwise the refusal is real (another owner claimed the request)."""
        out = list(ok)
        for k, (j, c) in enumerate(zip(p.jobs, p.commits)):
            if out[k]:
                continue
            rec = await self.store.get(j.rid)
            out[k] = (rec is not None and rec.epoch == c.epoch and rec.output == j.req.output
                      and (c.status is None or rec.status == c.status))
            if out[k]:
                log.info("commit of %s had landed before the store went away", j.rid)
        return out

    def _stream(self, j: Job, toks: list[int], now: float) -> None:
        if toks:
            if j.first_token_at is None:
                j.first_token_at = now
                if self.metrics:
                    self.metrics.ttft.observe(now - j.submitted)
            elif self.metrics:
                # tokens of one step arrive together: spread the step's latency over them
                for _ in toks:
                    self.metrics.itl.observe((now - j.last_token_at) / len(toks))
            j.last_token_at = now
        j.detok.push(toks)
        j.text = self.tok.decode(j.req.output)
        finish = j.req.finish_reason
        cut = min((j.text.find(s) for s in j.stop if s in j.text), default=-1)
        if cut >= 0:
            j.text, finish = j.text[:cut], "stop"
            j.req.finish_reason = "stop"
        # hold back a tail that might be the start of a stop string, until it is decided
        hold = 0 if finish else max((len(s) - 1 for s in j.stop), default=0)
        upto = max(j.sent_chars, len(j.text) - hold)
        if j.text.endswith("\ufffd") and not finish:
            upto = min(upto, len(j.text) - 1)
        j.events.put_nowait(Event(toks, j.text[j.sent_chars:upto], finish))
        j.sent_chars = upto

    async def _reap(self) -> None:
        """Step boundary: drop cancelled (client gone) and timed-out requests from the queue and the batch, free
        their KV and draft sessions, record them. A request in a step whose commit is held leaves that step too."""
        now = time.perf_counter()
        for j in self.waiting + self.running:
            if not j.cancelled and j.deadline is not None and now >= j.deadline and not j.req.finish_reason:
                j.timed_out = True
        gone = [j for j in self.running if j.cancelled or j.timed_out]
        expired = [j for j in self.waiting if j.cancelled or j.timed_out]
        if not gone and not expired:
            return
        if expired:
            self.waiting = [j for j in self.waiting if j not in expired]
        self.running = [j for j in self.running if j not in gone]
        for j in expired + gone:
            lens = [j.req.committed_len]
            if self._pending is not None and j in self._pending.jobs:
                # its last step is uncommitted (store down): the record holds one of these two lengths
                lens = [self._pending.pre_len[self._pending.jobs.index(j)], j.req.committed_len]
                self._pending.drop(j)
                if not self._pending.jobs:
                    self._pending = None
            reason = "cancelled" if j.cancelled else "timeout"
            j.req.finish_reason = reason
            if self.metrics:
                self.metrics.requests.labels(finished_reason=reason, **self.metrics.labels).inc()
            if reason == "timeout":
                # the client is still there: record the end first, so what it is told is what the store says
                await self._record_end(j, reason, lens)
                j.events.put_nowait(Event([], j.text[j.sent_chars:], "timeout"))
                j.sent_chars = len(j.text)
                continue
            task = asyncio.create_task(self._record_end(j, reason, lens))  # client gone: no one waits for it
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        await self._release(gone)
        self._gauges()

    async def _record_end(self, j: Job, reason: str, lens: list[int]) -> None:
        try:
            await self.store.commit([Commit(j.rid, j.record.epoch, n, [], status="cancelled", finish_reason=reason,
                                            stats=dataclasses.asdict(j.req.stats)) for n in lens])
        except StoreUnavailable:
            log.warning("could not record %s of %s: state store unavailable", reason, j.rid)

    async def _release(self, jobs: list[Job]) -> None:
        """Free KV (under the engine lock) and the draft sessions (off the event loop: it is a blocking RPC)."""
        if not jobs:
            return
        if self._lost.is_set():            # the compute thread may sit in an abandoned call: touch nothing of it
            return
        async with self.engine_lock:
            for j in jobs:
                if j.req.seq >= 0 and self.engine.has_sequence(j.req.seq):
                    self.engine.release(j.req.seq)
                j.req.seq = -1
        forget = getattr(self.planner, "forget", None)     # the planner's per-request history
        if forget is not None:
            for j in jobs:
                forget(j.rid)
        if self.drafter is not None:
            await compute.run(self._release_drafts, [j.rid for j in jobs])

    def _release_drafts(self, rids: list[str]) -> None:
        try:
            self.drafter.release_all(rids)          # a draft server's sessions in one call
        except Exception:  # noqa: BLE001 - best effort; the draft server evicts idle sessions itself
            pass

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.running.set(len(self.running))
            self.metrics.waiting.set(len(self.waiting))
            if hasattr(self.metrics, "kv_free_tokens"):
                self.metrics.kv_free_tokens.set(self.engine.kv_free_tokens)
            if hasattr(self.metrics, "observe_cache"):
                self.metrics.observe_cache(self.engine)
