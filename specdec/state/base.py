"""Request state: the record, the commit, the store interface and its errors.

A request's whole replay/resume state is its record: with `params["seed"]`, `committed_len` is the RNG position
(see DESIGN.md "Coins"), so a target that claims a request can continue it token-for-token from the store alone.
Commits are compare-and-set on (epoch, committed_len): a token is committed once, and an owner fenced off by a
later `claim` cannot write.
"""
from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from specdec.errors import InvalidRequest, SpecdecError

RUNNING, FINISHED, CANCELLED, FAILED = "running", "finished", "cancelled", "failed"
STATUSES = (RUNNING, FINISHED, CANCELLED, FAILED)


def check_rid(rid: str) -> None:
    """Ids become Redis key names, and `{ns}:req:{rid}:out` holds a request's output: an id ending in ":out" could
    name another request's output key, so both stores refuse it (and the empty id)."""
    if not rid or rid.endswith(":out"):
        raise InvalidRequest(f"invalid request id {rid!r}", field="id", remedy="use a non-empty id not ending in ':out'")


class StoreError(SpecdecError):
    """Base class of state store errors."""


class RequestExists(StoreError):
    def __init__(self, rid: str):
        self.rid = rid
        super().__init__(f"request {rid!r} already exists", field="id", remedy="use a new request id")


class UnknownRequest(StoreError):
    def __init__(self, rid: str):
        self.rid = rid
        super().__init__(f"request {rid!r} not found (never created, deleted or expired)", field="id")


class StoreUnavailable(StoreError):
    """The backing store cannot be reached (the service answers 503). After a failed `commit` the outcome is unknown:
    re-read the record with `get` to learn whether the tokens landed."""

    def __init__(self, message: str):
        super().__init__(message, remedy="check that Redis is running and reachable at the configured URL")


@dataclass
class RequestRecord:
    rid: str
    key_hash: str = ""                      # hash of the API key that created it; "" when auth is off
    target_model: str = ""
    draft_model: str = ""
    params: dict = field(default_factory=dict)   # temperature, top_k, top_p, min_p, seed (always set if non-greedy)
    mode: str = ""
    gamma: int = 0
    max_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)   # committed generated tokens
    status: str = RUNNING
    finish_reason: str | None = None
    owner: str = ""                         # target instance id
    epoch: int = 1                          # fencing token, bumped by every claim
    stats: dict = field(default_factory=dict)
    created: float = 0.0
    updated: float = 0.0

    @property
    def committed_len(self) -> int:
        """Prompt + committed output: the absolute position of the next token, i.e. the request's RNG position."""
        return len(self.prompt) + len(self.output)

    def copy(self) -> RequestRecord:
        """A copy sharing no mutable state (stores hand out copies, so callers cannot edit stored state in place)."""
        return RequestRecord(
            rid=self.rid, key_hash=self.key_hash, target_model=self.target_model, draft_model=self.draft_model,
            params=copy.deepcopy(self.params), mode=self.mode, gamma=self.gamma, max_tokens=self.max_tokens,
            stop=list(self.stop), prompt=list(self.prompt), output=list(self.output), status=self.status,
            finish_reason=self.finish_reason, owner=self.owner, epoch=self.epoch, stats=copy.deepcopy(self.stats),
            created=self.created, updated=self.updated)


@dataclass
class Commit:
    """Append `tokens` to request `rid` iff its epoch is `epoch` and its committed length is `expected_len`.
    `status`, `finish_reason`, `stats` replace the stored values when not None (zero tokens + a status is how a
    request is finished or cancelled)."""
    rid: str
    epoch: int
    expected_len: int
    tokens: list[int]
    status: str | None = None
    finish_reason: str | None = None
    stats: dict | None = None


class StateStore(ABC):
    """Async request state store. Implementations: MemoryStore (one process) and RedisStore (shared, durable)."""

    ttl_s: float

    @abstractmethod
    async def create(self, rec: RequestRecord) -> None:
        """Write `rec` atomically with the store's TTL; epoch starts at 1 and `created`/`updated` default to now.
        Raises RequestExists if the id exists (never overwrites)."""

    @abstractmethod
    async def get(self, rid: str) -> RequestRecord | None:
        """The record, or None when absent or expired."""

    @abstractmethod
    async def claim(self, rid: str, owner: str) -> int:
        """Take ownership (resume): atomically epoch += 1 and owner = `owner`; returns the new epoch. Commits carrying
        an older epoch fail from now on. Raises UnknownRequest when absent."""

    @abstractmethod
    async def commit(self, commits: list[Commit]) -> list[bool]:
        """Apply each commit atomically (compare-and-set, see Commit), in order; True where it applied. A whole batch
        costs one round trip to the backing store."""

    @abstractmethod
    async def delete(self, rid: str) -> None:
        """Remove the record (no error when absent)."""

    @abstractmethod
    async def ping(self) -> bool:
        """True when the store answers."""

    @abstractmethod
    async def close(self) -> None:
        """Release connections."""
