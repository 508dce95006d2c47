"""Continuous batching on the target: admission queue -> running batch -> one speculative step -> commit -> stream.

One asyncio task owns the engine. Each iteration admits waiting requests while the running batch and the KV budget
allow (validation and the state-store record happen before a request ever reaches the queue), runs one
`speculative_step` over the whole running batch in a worker thread, commits every request's new tokens to the store
in one round trip (compare-and-set on committed length, fenced by epoch), and only then streams them.

A commit the store refuses (another owner took the request) ends that request with an error; a store that is down
rolls the step back — the tokens are regenerated identically next step, since they are a pure function of
(seed, committed length) — so nothing is lost or duplicated.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from specdec.engine.engine import Engine
from specdec.engine.tokenizer import StreamDecoder
from specdec.spec.propose import Drafter
from specdec.spec.step import SpecRequest, StepInfo, plan_full, speculative_step
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

    @property
    def rid(self) -> str:
        return self.req.rid


@dataclasses.dataclass
class SchedulerConfig:
    max_running: int = 16
    max_queue: int = 64
    layout: str = "compact"
    step_delay_s: float = 0.0        # fault injection (tests): a slow target
    instance_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])


class Scheduler:
    def __init__(self, engine: Engine, drafter: Drafter | None, store: StateStore, tokenizer,
                 cfg: SchedulerConfig = SchedulerConfig(), metrics=None, trace=None):
        self.engine, self.drafter, self.store, self.tok = engine, drafter, store, tokenizer
        self.cfg, self.metrics, self.trace = cfg, metrics, trace
        self.waiting: list[Job] = []
        self.running: list[Job] = []
        self.engine_lock = asyncio.Lock()          # the engine is not re-entrant: steps, prefills, Verify calls
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

    # -- admission --------------------------------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are queued (limit {self.cfg.max_queue})")
        job.detok = StreamDecoder(self.tok)
        if job.req.output:  # resumed: the text of what was already committed
            job.detok.push(job.req.output)
            job.text = self.tok.decode(job.req.output)
            job.sent_chars = len(job.text)
        self.waiting.append(job)
        self._wake.set()
        self._gauges()
        return job

    def cancel(self, job: Job) -> None:
        """Client gone: the job leaves the batch at the next step boundary; KV and draft session are freed."""
        job.cancelled = True
        self._wake.set()

    def _kv_need(self, r: SpecRequest) -> int:
        return len(r.prompt) + r.max_tokens + r.gamma + 1

    def _kv_budget_left(self) -> int:
        used = sum(self._kv_need(j.req) for j in self.running)
        return self.engine.kv.num_pages * self.engine.kv.page_size - used - self.engine.kv.page_size * len(
            self.running)

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
        async with self.engine_lock:
            await asyncio.to_thread(self._prefill, admitted)
        self.running += admitted
        self._gauges()

    def _prefill(self, jobs: list[Job]) -> None:
        """KV for every committed token but the anchor (prompt, plus the output of a resumed request)."""
        pre = []
        for j in jobs:
            j.req.seq = self.engine.new_sequence()
            ctx = j.req.committed[:-1]
            if ctx:
                pre.append((j.req.seq, ctx))
        if pre:
            self.engine.prefill([s for s, _ in pre], [c for _, c in pre])

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
                await self._reap_cancelled()
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
            except Exception:  # noqa: BLE001 - a bug in one step must not kill the server; fail the batch loudly
                log.exception("scheduler step failed; failing the running requests")
                failed, self.running = self.running, []
                for j in failed:
                    j.events.put_nowait(Event([], "", error="internal error during generation"))
                await self._release(failed)

    async def _step(self) -> None:
        t_start = time.perf_counter()
        batch = list(self.running)
        before = [(len(j.req.output), j.req.draft_seen) for j in batch]
        async with self.engine_lock:
            info: StepInfo = await asyncio.to_thread(speculative_step, self.engine, self.drafter,
                                                     [j.req for j in batch], layout=self.cfg.layout, plan=plan_full)
        self.steps += 1
        if self.cfg.step_delay_s:
            await asyncio.sleep(self.cfg.step_delay_s)
        commits = [Commit(j.rid, j.record.epoch, len(j.req.prompt) + n0, toks,
                          status="finished" if j.req.finish_reason else None, finish_reason=j.req.finish_reason,
                          stats=dataclasses.asdict(j.req.stats) if j.req.finish_reason else None)
                   for j, (n0, _), toks in zip(batch, before, info.emitted)]
        t_commit = time.perf_counter()
        try:
            ok = await self.store.commit(commits)
        except StoreUnavailable:
            log.warning("state store unavailable: rolling the step back, retrying")
            async with self.engine_lock:
                for j, (n0, seen) in zip(batch, before):
                    self._rollback(j, n0, seen)
            await asyncio.sleep(0.2)
            return
        now = time.perf_counter()
        if self.metrics:
            self.metrics.observe_step(batch, info, now - t_start)
        if self.trace:
            self.trace.write([j.req for j in batch], info, commit_ms=(now - t_commit) * 1e3)
        for j, good, toks in zip(batch, ok, info.emitted):
            if not good:
                j.events.put_nowait(Event([], "", error="request is owned by another target instance"))
                j.req.finish_reason = "error"
                continue
            self._stream(j, toks, now)
        self.running = [j for j in self.running if not j.req.finish_reason]
        await self._release([j for j in batch if j.req.finish_reason])
        self._gauges()

    def _rollback(self, j: Job, n_out: int, draft_seen: int) -> None:
        r = j.req
        del r.output[n_out:]
        r.finish_reason, r.draft_seen = None, min(draft_seen, r.committed_len)
        self.engine.truncate(r.seq, min(self.engine.length(r.seq), r.committed_len - 1))

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

    async def _reap_cancelled(self) -> None:
        gone = [j for j in self.running if j.cancelled]
        if not gone:
            return
        self.running = [j for j in self.running if not j.cancelled]
        for j in gone:
            j.req.finish_reason = "cancelled"
            asyncio.create_task(self._record_cancel(j))
        await self._release(gone)
        self._gauges()

    async def _record_cancel(self, j: Job) -> None:
        try:
            await self.store.commit([Commit(j.rid, j.record.epoch, j.req.committed_len, [], status="cancelled",
                                            finish_reason="cancelled")])
        except StoreUnavailable:
            pass

    async def _release(self, jobs: list[Job]) -> None:
        """Free KV (under the engine lock) and the draft sessions (off the event loop: it is a blocking RPC)."""
        if not jobs:
            return
        async with self.engine_lock:
            for j in jobs:
                if j.req.seq >= 0 and j.req.seq in self.engine.kv:
                    self.engine.release(j.req.seq)
                j.req.seq = -1
        if self.drafter is not None:
            await asyncio.to_thread(self._release_drafts, [j.rid for j in jobs])

    def _release_drafts(self, rids: list[str]) -> None:
        for rid in rids:
            try:
                self.drafter.release(rid)
            except Exception:  # noqa: BLE001 - best effort; the draft server evicts idle sessions itself
                pass

    def _gauges(self) -> None:
        if self.metrics:
            self.metrics.running.set(len(self.running))
            self.metrics.waiting.set(len(self.waiting))
