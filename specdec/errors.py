"""Typed errors. Every user-facing error names the field, the value and the remedy, so the CLI, REST (400) and
gRPC (INVALID_ARGUMENT) layers can all show the same message without reaching into a traceback."""
from __future__ import annotations


class SpecdecError(Exception):
    """Base class. `field` is the request/config field at fault (None for environment problems)."""

    def __init__(self, message: str, *, field: str | None = None, remedy: str | None = None):
        self.field, self.remedy, self.detail = field, remedy, message
        text = f"{field}: {message}" if field else message
        super().__init__(f"{text}. {remedy}" if remedy else text)


class InvalidRequest(SpecdecError):
    """The request cannot be honoured as asked (bad value, out of range, beyond context, unsupported combination)."""


class ModelError(SpecdecError):
    """A model cannot be found, read or trusted (unknown preset, missing/corrupt file, checksum mismatch)."""


class KVPoolExhausted(SpecdecError):
    """Not enough free KV pages. Callers queue the request and retry when pages are freed."""

    def __init__(self, needed: int, free: int, page_size: int):
        self.needed, self.free = needed, free
        super().__init__(f"KV pool exhausted: need {needed} more pages of {page_size} tokens, {free} free",
                         remedy="wait for running requests to finish, or start with a larger --kv-tokens")


class BackendDead(SpecdecError):
    """The model backend as a whole cannot run any more (a tensor-parallel worker died or hung). Not a request's
    fault: the server stops taking work, ends in-flight requests with a retryable error and exits for a restart."""
