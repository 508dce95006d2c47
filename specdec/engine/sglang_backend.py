"""An SGLang server as the target's verify backend (`--backend sglang --sglang-url URL`).

SGLang runs the model (its own TP, graphs, radix cache); this process keeps scheduling, acceptance, coins, state and
the APIs. Per step there is one batched scoring call: native `/generate` with, per request, `input_ids` = the
committed context + the drafts being verified, `max_new_tokens` 1, `return_logprob`, `logprob_start_len` = the anchor's
position and `top_logprobs_num` K. The answer holds, per verified row, the K most likely ids with their log-probabilities
(the rows after the anchor in `input_top_logprobs`, the bonus row in `output_top_logprobs`).

Acceptance does not need p itself for greedy and coupled modes, only the token plain decoding emits at each row
(`speculative.topk.decide`): greedy from the top-1 (ties to the lower id, like argmax in the embedded engine), seeded
coupled sampling when the top-K certifies it. A row the top-K does not decide is asked again with a larger K, up to
the whole vocabulary, where `decide` is plain decoding itself; such re-asks are counted (`stats`). Rejection mode
needs all of p (the residual) and is refused through the capability table (CAPS).

KV "sequences" are bookkeeping here: a sequence is the token list SGLang will be sent; its radix cache keeps the
prefixes, so truncating (a rejected branch) is only a list slice and prefill costs no call.

Scoring calls are idempotent (temperature 0, nothing written), so transport failures are retried with backoff; a
server that stays down makes the step fail with `BackendUnavailable` (a retryable error for the requests; their
committed tokens are in the state store) and `reachable()` false, which /health reports as 503.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import httpx
import torch

from ..errors import SpecdecError
from ..speculative.topk import TopKRow, decide
from ..speculative.validation import Capabilities
from .model import ModelConfig

log = logging.getLogger("specdec.sglang")

# Greedy and coupled only: both need just the token plain decoding emits per row, which the top-K gives (certified).
CAPS = Capabilities("sglang", acceptance_modes=("greedy", "coupled"))


class BackendUnavailable(SpecdecError):
    """The SGLang server did not answer a scoring call (after retries). Retryable: nothing was committed."""


@dataclasses.dataclass
class ScoreStats:
    calls: int = 0                 # HTTP scoring calls, re-asks included
    rows: int = 0                  # verified rows scored in first calls
    decided: int = 0               # rows whose token the first top-K certified
    fallback_rows: int = 0         # first-call rows the top-K did not certify: asked again with a larger K
    fallback_calls: int = 0        # re-ask calls (K x 8 each round, up to the whole vocabulary)
    retries: int = 0               # transport retries
    cached_tokens: int = 0         # prefix tokens SGLang reused from its radix cache (first calls)
    input_tokens: int = 0
    ms: float = 0.0                # wall time of scoring calls


@dataclasses.dataclass
class Row:
    """One request's rows to verify this step, in the embedded engine's terms (verify.VerifyItem)."""
    seq: int
    start: int                     # the anchor's position (committed length - 1) = logprob_start_len
    anchor: int
    drafts: list[int]              # the verify_len - 1 drafts being verified
    params: object                 # SamplingParams
    ids: list[int] = dataclasses.field(default_factory=list)   # what SGLang is sent (filled by target_tokens)


class SGLangBackend:
    """The Backend protocol's bookkeeping plus `target_tokens`, the top-K verify path the speculative step uses."""
    caps = CAPS
    batch_invariant = False        # SGLang's rows may round differently with the batch; acceptance stays exact per row
    dtype = torch.float32          # what its log-probabilities arrive as
    device = torch.device("cpu")

    def __init__(self, url: str, cfg: ModelConfig, *, k: int = 20, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 0.5, transport: httpx.BaseTransport | None = None):
        if k < 1:
            raise ValueError("k must be >= 1")
        self.url, self.cfg, self.k = url.rstrip("/"), cfg, k
        self.retries, self.backoff_s = retries, backoff_s
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=5.0),
                                 transport=transport)
        self.stats = ScoreStats()
        self._seqs: dict[int, list[int]] = {}
        self._next = 0
        self._lock = threading.Lock()
        self._reachable = True
        self._checked_at = 0.0
        self.model_info: dict = {}

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    # -- start-up checks ------------------------------------------------------------------------------------------
    def check(self, tokenizer=None, probe: str = "Hello, world! 12345") -> dict:
        """Fail loudly at start if the server is not there or serves another vocabulary than ours."""
        try:
            self.http.get("/health").raise_for_status()
            info = self.http.get("/model_info").json()
        except httpx.HTTPError as e:
            raise SpecdecError(f"no SGLang server answers at {self.url} ({e}); start it first "
                               f"(python -m sglang.launch_server ...) or fix --sglang-url") from e
        if not info.get("is_generation", True):
            raise SpecdecError(f"the SGLang server at {self.url} serves a non-generative model ({info.get('model_path')})")
        self.model_info = info
        # The largest id of our vocabulary must score (a smaller SGLang vocabulary errors here) ...
        V = self.vocab_size
        ans = self._post({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                          "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 1,
                          "token_ids_logprob": [V - 1]})
        if not isinstance(ans, dict) or "meta_info" not in ans:
            raise SpecdecError(f"the SGLang server at {self.url} does not score token ids (answer {str(ans)[:200]})")
        # ... and the tokenizers must agree, or drafts and text would mean different things on the two sides.
        if tokenizer is not None:
            ours = tokenizer.encode(probe)
            try:
                theirs = self.http.post("/tokenize", json={"prompt": probe, "add_special_tokens": False}).json()
                theirs = theirs.get("tokens", theirs.get("input_ids"))
            except (httpx.HTTPError, ValueError, AttributeError):
                theirs = None
            if theirs is not None and list(theirs) != list(ours):
                raise SpecdecError(f"the SGLang server at {self.url} ({info.get('model_path')}) tokenizes differently "
                                   f"from this target's model: {theirs} vs {ours}; serve the same weights "
                                   f"(specdec export-hf PRESET DIR, then --model-path DIR)")
        return info

    # -- sequences: bookkeeping only (SGLang's radix cache holds the KV) -----------------------------------------
    def new_sequence(self) -> int:
        with self._lock:
            self._next += 1
            self._seqs[self._next] = []
            return self._next

    def release(self, seq: int) -> None:
        self._seqs.pop(seq, None)

    def length(self, seq: int) -> int:
        return len(self._seqs[seq])

    def truncate(self, seq: int, n: int) -> None:
        del self._seqs[seq][n:]

    def has_sequence(self, seq: int) -> bool:
        return seq in self._seqs

    def prefill(self, seqs: list[int], prompts: list[list[int]], chunk_tokens: int = 512) -> None:
        # No call: the first scoring call sends the context, and SGLang caches it.
        for s, p in zip(seqs, prompts):
            self._seqs[s] = list(p)

    # The scheduler sizes its batch by KV capacity; SGLang manages its own memory (and queues), so ours is unbounded.
    kv_capacity_tokens = 1 << 40
    kv_page_size = 1

    @property
    def kv_free_tokens(self) -> int:
        return self.kv_capacity_tokens - sum(len(s) for s in self._seqs.values())

    def forward(self, inputs, hidden_layers=()):
        from ..errors import InvalidRequest   # e.g. the stateless gRPC Verify, which needs whole logit rows
        raise InvalidRequest("this target runs on the sglang backend, which scores top-K rows, not whole logits",
                             field="backend", remedy="use Generate / the REST API, or a target on --backend embedded")

    # -- health ---------------------------------------------------------------------------------------------------
    def healthy(self) -> bool:
        # Not "dead": an SGLang outage is transient (requests fail retryably, /health says 503 via reachable()).
        return True

    def reachable(self, max_age_s: float = 1.0) -> bool:
        if time.monotonic() - self._checked_at > max_age_s:
            try:
                self._reachable = self.http.get("/health", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                self._reachable = False
            self._checked_at = time.monotonic()
        return self._reachable

    def close(self) -> None:
        self.http.close()

    # -- scoring --------------------------------------------------------------------------------------------------
    def _post(self, body: dict):
        """POST /generate, retried on transport errors and 5xx (scoring is idempotent)."""
        err: Exception | None = None
        # Known down (a failed call or health probe within the last few seconds): one try, so the scheduler's reruns
        # of a failed step and the requests behind it fail fast instead of each waiting out the backoff again.
        down = not self._reachable and time.monotonic() - self._checked_at < 5.0
        for attempt in range(1 if down else self.retries + 1):
            if attempt:
                self.stats.retries += 1
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                t0 = time.perf_counter()
                r = self.http.post("/generate", json=body)
                self.stats.ms += (time.perf_counter() - t0) * 1e3
                if r.status_code >= 500:
                    err = BackendUnavailable(f"SGLang answered {r.status_code}: {r.text[:200]}")
                    continue
                if r.status_code != 200:   # a request it refuses will not improve by retrying
                    raise SpecdecError(f"SGLang refused a scoring call ({r.status_code}): {r.text[:300]}")
                self._reachable = True
                return r.json()
            except httpx.TransportError as e:
                err = e
        self._reachable, self._checked_at = False, time.monotonic()
        raise BackendUnavailable(f"the SGLang server at {self.url} is unavailable ({err})") from err

    def score(self, rows: list[Row], k: int | list[int]) -> list[list[TopKRow]]:
        """One batched call: for each Row its verified rows' top-K (verify_len of them: anchor row .. bonus row)."""
        ks = k if isinstance(k, list) else [k] * len(rows)
        body = {"input_ids": [r.ids for r in rows],
                "sampling_params": [{"max_new_tokens": 1, "temperature": 0.0} for _ in rows],
                "return_logprob": [True] * len(rows), "logprob_start_len": [r.start for r in rows],
                "top_logprobs_num": ks, "return_text_in_logprobs": False}
        ans = self._post(body)
        self.stats.calls += 1
        if isinstance(ans, dict):
            ans = [ans]
        if len(ans) != len(rows):
            raise SpecdecError(f"SGLang answered {len(ans)} items for {len(rows)} requests")
        out = []
        for r, a in zip(rows, ans):
            m = a["meta_info"]
            # input_top_logprobs[j] is position start + j's distribution given what precedes it; the anchor's own
            # entry (j = 0) is empty; entries 1.. are the rows that check drafts, output_top_logprobs[0] the bonus row.
            tops = list(m["input_top_logprobs"][1:]) + [m["output_top_logprobs"][0]]
            if len(tops) != len(r.drafts) + 1:
                raise SpecdecError(f"SGLang returned {len(tops)} rows for {len(r.drafts) + 1} verified positions")
            out.append([self._row(t) for t in tops])
            self.stats.cached_tokens += int(m.get("cached_tokens", 0))
            self.stats.input_tokens += len(r.ids)
        return out

    def _row(self, entries) -> TopKRow:
        lp = torch.tensor([float(e[0]) for e in entries], dtype=torch.float64)
        ids = torch.tensor([int(e[1]) for e in entries], dtype=torch.long)
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < self.vocab_size):
            raise SpecdecError(f"SGLang returned token id {int(ids.max())} outside this model's vocabulary "
                               f"[0, {self.vocab_size}): it serves another model")
        return TopKRow(ids, lp, self.vocab_size)

    def target_tokens(self, rows: list[Row]) -> list[list[int]]:
        """Per request, plain decoding's token at each verified row up to and including the first row whose token
        differs from the draft it checks (or the bonus row): exactly what greedy / coupled acceptance needs."""
        for r in rows:   # like the embedded KV: the sequence now holds the anchor and drafts; the commit truncates
            ctx = self._seqs[r.seq]
            if len(ctx) < r.start:
                raise SpecdecError(f"sequence {r.seq} holds {len(ctx)} tokens, the anchor is at {r.start}")
            r.ids = self._seqs[r.seq] = ctx[:r.start] + [r.anchor] + r.drafts
        out: list[list[int]] = [[] for _ in rows]
        pending = list(range(len(rows)))       # requests with an undecided row, from len(out[i]) on
        k = self.k
        first = True
        while pending:
            tops = self.score([rows[i] for i in pending], k)
            again = []
            for i, top in zip(pending, tops):
                r = rows[i]
                for j in range(len(out[i]), len(top)):
                    t = decide(top[j], r.params, r.start + 1 + j)
                    if first:
                        self.stats.rows += 1
                    if t is None:
                        self.stats.fallback_rows += first     # rows = decided + fallback_rows (first calls)
                        again.append(i)
                        break
                    if first:
                        self.stats.decided += 1
                    out[i].append(t)
                    if j == len(r.drafts) or t != r.drafts[j]:
                        break                  # the step ends at the first mismatch (or the bonus row)
            if again and k >= self.vocab_size:
                raise SpecdecError("a whole row did not decide a token")   # decide on a whole row never declines
            if again:
                self.stats.fallback_calls += 1
            k = self.vocab_size if k * 8 >= self.vocab_size else k * 8
            pending, first = again, False
        return out


def register_metrics(registry, backend: SGLangBackend) -> None:
    """The scoring-call counters on the target's /metrics (certification re-asks, retries, radix-cache reuse)."""
    from prometheus_client import Gauge
    for field, doc in [("calls", "SGLang scoring calls, re-asks included"),
                       ("rows", "verified rows scored (first calls)"),
                       ("decided", "rows whose token the first top-K certified"),
                       ("fallback_rows", "rows asked again with a larger K (not certified by the first top-K)"),
                       ("fallback_calls", "re-ask calls"), ("retries", "transport retries of scoring calls"),
                       ("cached_tokens", "prompt tokens SGLang reused from its radix cache"),
                       ("input_tokens", "tokens sent in first scoring calls"), ("ms", "wall ms in scoring calls")]:
        Gauge(f"specdec_sglang_{field}", doc, registry=registry).set_function(
            lambda f=field: getattr(backend.stats, f))


def open_sglang(url: str, model: str, *, k: int = 20, timeout_s: float = 60.0, retries: int = 3, check: bool = True):
    """A LoadedBackend for an SGLang server serving the same weights as `model` (a preset name or path, loaded here
    only for its config and tokenizer), checked at start."""
    from .backend import LoadedBackend
    from .registry import load
    t0 = time.perf_counter()
    logging.getLogger("httpx").setLevel(logging.WARNING)   # not a log line per scoring call
    lm = load(model)              # for its config and tokenizer; the weights are dropped (SGLang holds its own)
    be = SGLangBackend(url, lm.cfg, k=k, timeout_s=timeout_s, retries=retries)
    if check:
        be.check(lm.tokenizer)
    return LoadedBackend(lm.name, be, lm.tokenizer, time.perf_counter() - t0)


def open_sglang_for_server(args):
    """`--backend sglang` of the target server: refuse flags that mean nothing here, then open and check."""
    from ..errors import InvalidRequest
    if not args.sglang_url:
        raise InvalidRequest("--backend sglang needs the SGLang server's address", field="sglang_url",
                             remedy="pass --sglang-url http://HOST:PORT (or SPECDEC_SGLANG_URL)")
    if args.tp != 1:
        raise InvalidRequest(f"--tp {args.tp} with --backend sglang: tensor parallelism is the SGLang server's",
                             field="tp", remedy="start SGLang with --tp N and leave this server at --tp 1")
    if args.acceptance == "rejection":
        raise InvalidRequest("rejection acceptance needs the whole target distribution; the sglang backend scores "
                             "top-K rows", field="acceptance", remedy="use --acceptance coupled")
    if args.sglang_top_k < 1:
        raise InvalidRequest(f"{args.sglang_top_k} is not a number of log-probabilities", field="sglang_top_k",
                             remedy="use 1 or more (20 is a good default)")
    return open_sglang(args.sglang_url, args.model, k=args.sglang_top_k, timeout_s=args.sglang_timeout_s)


__all__ = ["SGLangBackend", "BackendUnavailable", "CAPS", "Row", "ScoreStats", "open_sglang", "open_sglang_for_server", "register_metrics"]
