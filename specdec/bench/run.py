"""Running a prompt set: in process (the library's loop) or through a running stack (REST), always with the baseline
(speculation off, same engine, same prompts) in the same run."""
from __future__ import annotations

import asyncio
import json
import time

from tqdm import tqdm

from ..speculative.generator import GenRequest, SpeculativeGenerator
from ..speculative.sampling import SamplingParams
from .report import RequestRecord, StepRecord


def run_inprocess(engine, drafter, prompts: list[list[int]], *, max_tokens: int, concurrency: int,
                  params: SamplingParams, gamma: int, mode: str, layout: str, plan=None, stop_ids=frozenset(),
                  desc: str = "", tree_rows: int = 0) -> tuple[list[RequestRecord], list[StepRecord], float]:
    """Static batches of `concurrency` requests through SpeculativeGenerator (drafter None = target-only). Each batch
    starts cold: the prefix caches of the target and of a model drafter are cleared first, as every configuration
    runs the same prompts (interleaved) and a later one would otherwise find them cached."""
    kw = {"plan": plan} if plan is not None else {}
    gen = SpeculativeGenerator(engine, drafter, gamma=gamma, mode=mode, layout=layout, tree_rows=tree_rows, **kw)
    reqs: list[RequestRecord] = []
    bar = tqdm(total=len(prompts), desc=desc, leave=False, disable=not desc)
    t0 = time.perf_counter()
    for b in range(0, len(prompts), concurrency):
        batch = prompts[b:b + concurrency]
        start = time.perf_counter()
        seen: dict[int, list[float]] = {i: [] for i in range(len(batch))}

        def on_tokens(i, toks):
            now = time.perf_counter()
            seen[i] += [now] * len(toks)

        for e in (engine, getattr(drafter, "engine", None), getattr(getattr(drafter, "model", None), "engine", None)):
            getattr(e, "clear_prefix_cache", lambda: None)()
        outs = gen.generate([GenRequest(p, params, max_tokens, stop_ids) for p in batch], on_tokens)
        for i, o in enumerate(outs):
            ts = seen[i]
            itl = [(b_ - a_) for a_, b_ in zip(ts, ts[1:])]
            reqs.append(RequestRecord(len(o.tokens), o.stats.steps, o.stats.drafted, o.stats.accepted,
                                      o.stats.drafted_per_pos, o.stats.accepted_per_pos,
                                      ts[0] - start if ts else None, itl))
        bar.update(len(batch))
    wall = time.perf_counter() - t0
    bar.close()
    steps = [StepRecord(s.draft_ms, s.verify_ms, s.accept_ms, s.rows, len(s.verify_len)) for s in gen.steps]
    return reqs, steps, wall


def _metric(text: str, name: str) -> float:
    """Sum of a metric's samples over all label sets."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in '{ ,}')


async def _one(client, url, body, rec_out, bar):
    t0 = time.perf_counter()
    stamps, usage, spec = [], None, None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if d.get("choices") and (d["choices"][0].get("text") or d["choices"][0].get("delta", {}).get("content")):
                stamps.append(time.perf_counter())
            if d.get("usage"):
                usage, spec = d["usage"], d.get("spec")
    n = usage["completion_tokens"] if usage else len(stamps)
    spec = spec or {}
    rec_out.append(RequestRecord(n, spec.get("steps", n), spec.get("drafted", 0), spec.get("accepted", 0), [], [],
                                 stamps[0] - t0 if stamps else None,
                                 [(b - a) for a, b in zip(stamps, stamps[1:])]))
    bar.update(1)


def run_rest(base_url: str, prompts: list[dict], *, max_tokens: int, concurrency: int, params: SamplingParams,
             speculative: dict | None, desc: str = "") -> tuple[list[RequestRecord], list[StepRecord], float]:
    """Streams every prompt through /v1/(chat/)completions at `concurrency`; per-step figures come from the server's
    /metrics deltas (steps, verify rows, draft / verify / step seconds) and per-position acceptance from its
    per-position counters."""
    import httpx

    async def main():
        recs: list[RequestRecord] = []
        sem = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(prompts), desc=desc, leave=False, disable=not desc)
        async with httpx.AsyncClient(timeout=600) as client:
            before = (await client.get(base_url + "/metrics")).text
            t0 = time.perf_counter()

            async def task(item):
                body = {"max_tokens": max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                        "top_k": params.top_k, "min_p": params.min_p, "seed": params.seed, "stream": True,
                        "stream_options": {"include_usage": True},
                        "speculative": speculative or {"enabled": False}}
                if "messages" in item:
                    url, body["messages"] = base_url + "/v1/chat/completions", item["messages"]
                else:
                    url, body["prompt"] = base_url + "/v1/completions", item["prompt"]
                async with sem:
                    await _one(client, url, body, recs, bar)

            await asyncio.gather(*[task(p) for p in prompts])
            wall = time.perf_counter() - t0
            after = (await client.get(base_url + "/metrics")).text
        bar.close()
        return recs, before, after, wall

    recs, before, after, wall = asyncio.run(main())

    def delta(name):
        return _metric(after, name) - _metric(before, name)

    n = int(delta("specdec:scheduler_steps_total"))
    per = {k: delta(f"specdec:step_{k}_seconds_total") * 1e3 / max(1, n) for k in ("draft", "verify", "total")}
    rows = delta("specdec:verify_rows_total") / max(1, n)
    round_trips = delta("specdec:store_round_trips")
    steps = [StepRecord(per["draft"], per["verify"], per["total"] - per["draft"] - per["verify"], int(rows))] * n
    def pos_delta(name, j):
        def get(text):
            return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines()
                       if x.startswith(name + "{") and f'position="{j}"' in x)
        return get(after) - get(before)

    for j in range(64):  # server-wide per-position deltas, carried by the first record
        d = pos_delta("specdec:spec_decode_num_draft_tokens_per_pos_total", j)
        if d <= 0 or not recs:
            break
        recs[0].drafted_per_pos.append(int(d))
        recs[0].accepted_per_pos.append(int(pos_delta("specdec:spec_decode_num_accepted_tokens_per_pos_total", j)))
    for st in steps[:1]:
        st.store_round_trips_per_step = round_trips / max(1, n)   # reported by summarize when present
    return recs, steps, wall
