"""Prometheus metrics, named like vLLM's (prefix specdec: instead of vllm:) so existing dashboards carry over."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.speculative.step import StepInfo

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5, 10, 20)


class Metrics:
    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        lab = {"model_name": model}
        self.labels = lab

        def counter(name, doc, extra=()):
            return Counter(name, doc, ["model_name", *extra], registry=r)

        self.num_drafts = counter("specdec:spec_decode_num_drafts", "Verify steps that carried draft tokens.")
        self.num_draft_tokens = counter("specdec:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("specdec:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("specdec:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted draft tokens by draft position.", ["position"])
        self.drafted_per_pos = counter("specdec:spec_decode_num_draft_tokens_per_pos",
                                       "Verified draft tokens by draft position.", ["position"])
        self.step_seconds = {k: counter(f"specdec:step_{k}_seconds", f"Scheduler step time: {k}.")
                             for k in ("draft", "verify", "total")}
        self.fallback_steps = counter("specdec:spec_decode_fallback_steps",
                                      "Request-steps run as plain decoding because the drafter failed.")
        self.step_retries = counter("specdec:step_retries",
                                    "Scheduler steps that raised and were rerun as plain decoding (same output).")
        self.step_failed_requests = counter("specdec:step_failed_requests",
                                            "Requests ended with a retryable error because no step could run them "
                                            "(committed tokens kept for resume).")
        self.generation_tokens = counter("specdec:generation_tokens", "Generated tokens.")
        self.prompt_tokens = counter("specdec:prompt_tokens", "Prompt tokens admitted.")
        self.requests = counter("specdec:request_success", "Finished requests.", ["finished_reason"])
        self.verify_rows = counter("specdec:verify_rows", "Target rows run by verify forwards.")
        self.steps = counter("specdec:scheduler_steps", "Speculative steps run.")
        self.running = Gauge("specdec:num_requests_running", "Requests in the running batch.", ["model_name"],
                             registry=r).labels(**lab)
        self.waiting = Gauge("specdec:num_requests_waiting", "Requests waiting for admission.", ["model_name"],
                             registry=r).labels(**lab)
        self.kv_free_tokens = Gauge("specdec:kv_free_tokens", "Target KV cache slots (tokens) held by no request.",
                                    ["model_name"], registry=r).labels(**lab)
        self.prefix_queries = counter("specdec:prefix_cache_queries",
                                      "Prompt tokens prefilled through the prefix cache (all but each prompt's last).")
        self.prefix_hits = counter("specdec:prefix_cache_hits",
                                   "Prompt tokens whose K/V the prefix cache held (not run again).")
        self._prefix_seen = (0, 0)
        self.store_errors = counter("specdec:state_store_errors",
                                    "Commit attempts that failed because the state store was unavailable.")
        self.store_round_trips = Gauge("specdec:store_round_trips", "Network round trips to the state store so far.",
                                       ["model_name"], registry=r).labels(**lab)
        self.feature_rows_recomputed = Gauge(
            "specdec:draft_feature_rows_recomputed", "Hidden-state rows the target recomputed to send a block draft "
            "server: text it ran before the draft server named the layers to tap, and the warm-up's own.",
            ["model_name"], registry=r).labels(**lab)
        self.catch_ups_withheld = Gauge(
            "specdec:draft_catch_ups_withheld", "Request-steps the planner asked no model draft for because the draft "
            "model's catch-up on text it had not seen would cost more than drafting could save.",
            ["model_name"], registry=r).labels(**lab)
        self.ttft = Histogram("specdec:time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=_LATENCY_BUCKETS, registry=r).labels(**lab)
        self.itl = Histogram("specdec:inter_token_latency_seconds", "Time between streamed tokens.", ["model_name"],
                             buckets=_LATENCY_BUCKETS, registry=r).labels(**lab)

    def observe_cache(self, engine) -> None:
        """The engine's prefix-cache totals since the last call (backends without the cache have none)."""
        q, h = getattr(engine, "prefix_queries", None), getattr(engine, "prefix_hits", None)
        if q is None or h is None:
            return
        q0, h0 = self._prefix_seen
        self.prefix_queries.labels(**self.labels).inc(q - q0)
        self.prefix_hits.labels(**self.labels).inc(h - h0)
        self._prefix_seen = (q, h)

    def observe_step(self, jobs, info: StepInfo, total_s: float) -> None:
        lab = self.labels
        self.steps.labels(**lab).inc()
        self.step_seconds["draft"].labels(**lab).inc(info.draft_ms / 1e3)
        self.step_seconds["verify"].labels(**lab).inc(info.verify_ms / 1e3)
        self.step_seconds["total"].labels(**lab).inc(total_s)
        self.verify_rows.labels(**lab).inc(info.rows)
        for j, v, a, toks in zip(jobs, info.verify_len, info.accepted, info.emitted):
            self.generation_tokens.labels(**lab).inc(len(toks))
            if not info.draft_ok:
                self.fallback_steps.labels(**lab).inc()
            if v > 1:
                self.num_drafts.labels(**lab).inc()
                self.num_draft_tokens.labels(**lab).inc(v - 1)
                self.num_accepted_tokens.labels(**lab).inc(a)
                for pos in range(v - 1):
                    self.drafted_per_pos.labels(position=str(pos), **lab).inc()
                for pos in range(a):
                    self.accepted_per_pos.labels(position=str(pos), **lab).inc()
            if j.req.finish_reason:
                self.requests.labels(finished_reason=j.req.finish_reason, **lab).inc()
