"""The target service core, shared by the REST and gRPC front ends: admit (validate -> record -> queue), resume by id,
and stateless Verify for external drafters."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import secrets
import time

import torch

from specdec.engine.engine import Engine
from specdec.errors import InvalidRequest
from specdec.speculative.accept import Mode, accept
from specdec.speculative.sampling import SamplingParams, probs
from specdec.speculative.step import SpecRequest
from specdec.speculative.validation import EMBEDDED, assign_seed, validate_request
from specdec.speculative.verify import VerifyItem, verify
from specdec.state import RequestExists, RequestRecord, StateStore, StoreUnavailable

from .scheduler import Event, Job, QueueFull, Scheduler


class NotFound(Exception):
    pass


class Forbidden(Exception):
    pass


@dataclasses.dataclass
class GenerationSpec:
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    speculative: bool = True
    gamma: int | None = None
    mode: str | None = None
    rid: str | None = None
    timeout_s: float | None = None      # deadline for the whole request (queue + generation); None: server default


def new_request_id() -> str:
    return "req-" + secrets.token_hex(16)       # 128 random bits: ids are unguessable


def check_timeout(timeout_s) -> None:
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or not 0 < timeout_s <= 86400:
        raise InvalidRequest(f"{timeout_s!r} is out of range", field="timeout_s",
                             remedy="use seconds in (0, 86400], or leave it unset for the server's default")


def key_hash(api_key: str | None) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest() if api_key else ""


class TargetService:
    def __init__(self, engine: Engine, scheduler: Scheduler, store: StateStore, tokenizer, *, model_name: str,
                 draft_name: str, gamma: int = 4, mode: str | None = None, caps=EMBEDDED, metrics=None):
        self.engine, self.scheduler, self.store, self.tok = engine, scheduler, store, tokenizer
        # mode: acceptance for sampled requests that name none (None: the capability table's default, coupled)
        self.model_name, self.draft_name, self.gamma, self.caps = model_name, draft_name, gamma, caps
        self.mode = mode or caps.default_acceptance
        self.metrics = metrics

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    async def admit(self, spec: GenerationSpec, api_key: str | None = None) -> Job:
        """Everything is checked before anything is written; then the record (with its seed), then the queue."""
        gamma = self.gamma if spec.gamma is None else spec.gamma
        mode = spec.mode or self.mode
        # a gamma the client sent is checked even with speculation off (the schema promises 1..max_gamma)
        checked = gamma if spec.speculative or spec.gamma is not None else 1
        validate_request(spec.prompt, spec.params, spec.max_tokens, checked, mode, self.caps,
                         self.engine.vocab_size, self.engine.cfg.max_seq_len, stop=spec.stop)
        if spec.rid is not None and (not isinstance(spec.rid, str) or not 0 < len(spec.rid) <= 128):
            raise InvalidRequest(f"{spec.rid!r} is not a valid id", field="request_id",
                                 remedy="use 1..128 characters, or leave it unset to get a generated id")
        check_timeout(spec.timeout_s)
        self.scheduler.check_capacity()     # refuse a full queue before writing the record (429, nothing written)
        params = assign_seed(spec.params, self.caps)
        rid = spec.rid or new_request_id()
        req = SpecRequest(rid, list(spec.prompt), params, spec.max_tokens,
                          Mode.GREEDY if params.greedy else Mode(mode), gamma if spec.speculative else 0,
                          self.tok.eos_ids)
        now = time.time()
        rec = RequestRecord(rid=rid, key_hash=key_hash(api_key), target_model=self.model_name,
                            draft_model=self.draft_name, params=dataclasses.asdict(params), mode=req.mode.value,
                            gamma=req.gamma, max_tokens=spec.max_tokens, stop=list(spec.stop), prompt=req.prompt,
                            output=[], status="running", finish_reason=None, owner=self.scheduler.cfg.instance_id,
                            epoch=1, stats={}, created=now, updated=now)
        try:
            await self.store.create(rec)
        except RequestExists:
            raise InvalidRequest(f"request {rid} already exists", field="request_id",
                                 remedy="resume it with resume=true, or use a new id") from None
        try:
            job = self.scheduler.submit(Job(req, rec, stop=tuple(spec.stop), timeout_s=spec.timeout_s))
        except QueueFull:
            # the queue filled while the record was written: undo it, so a retry with the same id works
            try:
                await self.store.delete(rid)
            except StoreUnavailable:
                pass
            raise
        if self.metrics:
            self.metrics.prompt_tokens.labels(**self.metrics.labels).inc(len(req.prompt))
        return job

    async def resume(self, rid: str, api_key: str | None = None, timeout_s: float | None = None) -> Job:
        """Continue a request from its committed tokens and seed (after a target restart, or from another instance).
        Its RNG state is (seed, committed length), so it ends with exactly the uninterrupted output."""
        check_timeout(timeout_s)
        rec = await self.store.get(rid)
        if rec is None:
            raise NotFound(f"no request {rid}")
        if rec.key_hash != key_hash(api_key):
            raise Forbidden(f"request {rid} belongs to another API key")
        if self._resumable(rec):
            self.scheduler.check_capacity()     # before the claim: a refused resume must not fence the running owner
            epoch = await self.store.claim(rid, self.scheduler.cfg.instance_id)   # fences any older owner
            # re-read after the fence: the previous owner may have committed between our read and the claim, and
            # a commit at the older length would be refused
            rec = await self.store.get(rid)
            if rec is None:
                raise NotFound(f"no request {rid}")
            rec.epoch = epoch
        params = SamplingParams(**rec.params)
        req = SpecRequest(rid, rec.prompt, params, rec.max_tokens, Mode(rec.mode), rec.gamma, self.tok.eos_ids,
                          output=list(rec.output))
        if not self._resumable(rec):
            job = Job(req, rec, stop=tuple(rec.stop))  # already finished: answer from the record
            job.resumed_tokens = len(rec.output)
            text = self.tok.decode(rec.output)
            job.events.put_nowait(Event(list(rec.output), text, rec.finish_reason or "length"))
            return job
        job = Job(req, rec, stop=tuple(rec.stop), timeout_s=timeout_s)
        job.resumed_tokens = len(rec.output)
        job = self.scheduler.submit(job)
        # the client gets the whole output: first what was committed before (queued ahead of any new tokens, since
        # nothing awaits between submit and here), then the rest as it comes
        job.events.put_nowait(Event(list(rec.output), job.text[:job.sent_chars]))
        return job

    @staticmethod
    def _resumable(rec: RequestRecord) -> bool:
        return rec.status == "running" and len(rec.output) < rec.max_tokens

    async def verify_block(self, context: list[int], drafts: list[int], q: torch.Tensor | None,
                           params: SamplingParams, mode: str | None) -> tuple[list[int], int, int | None]:
        """Stateless verify for an external drafter: context ends with the anchor. Returns (tokens, accepted, seed)."""
        if not context:
            raise InvalidRequest("the context is empty", field="context", remedy="send at least the anchor token")
        m = mode or self.mode
        validate_request(context, params, 1, max(1, len(drafts)), m, self.caps, self.engine.vocab_size,
                         self.engine.cfg.max_seq_len - len(drafts))
        bad = [t for t in drafts if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary [0, {self.engine.vocab_size})",
                                 field="draft_tokens")
        params = assign_seed(params, self.caps)
        mode_ = Mode.GREEDY if params.greedy else Mode(m)
        if mode_ is Mode.REJECTION and drafts and (q is None or q.shape[0] != len(drafts)):
            raise InvalidRequest("rejection mode needs one draft distribution per draft token", field="q")
        async with self.scheduler.engine_lock:
            return await self._verify_locked(context, drafts, q, params, mode_)

    async def _verify_locked(self, context, drafts, q, params, mode_):
        def run():
            seq = self.engine.new_sequence()
            try:
                if len(context) > 1:
                    self.engine.prefill([seq], [context[:-1]])
                (logits,), _ = verify(self.engine, [VerifyItem(seq, len(context) - 1, context[-1], drafts,
                                                               len(drafts) + 1)])
            finally:
                self.engine.release(seq)
            p = probs(logits, params)
            out = accept(p, q if mode_ is Mode.REJECTION else None, torch.tensor(drafts, dtype=torch.long),
                         torch.tensor([0, len(drafts) + 1]), [mode_], [params.seed], [len(context)])
            return out.tokens[0], int(out.num_accepted[0])
        tokens, accepted = await self.scheduler.run_engine(run)
        return tokens, accepted, params.seed
