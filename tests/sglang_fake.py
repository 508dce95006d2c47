"""A small SGLang-shaped scoring server over our own engine, for testing the sglang backend without SGLang.

A real HTTP server (in a thread) answering the subset of SGLang's native API the backend uses: /health, /model_info,
/tokenize and batched /generate with return_logprob, logprob_start_len and top_logprobs_num (the same field layout as
SGLang's answers: input_top_logprobs[0] empty, rows after the anchor, output_top_logprobs the last row, entries
[logprob, id, text]). Each item is scored from scratch on a float64 tiny model, so `logprob_rows` is the exact
reference the tests decode from. `down` makes it answer 503, as a restarting server does.

A stand-in for SGLang's wire format only, not for its numerics, batching or radix cache (cached_tokens is always 0):
the real-server checks are tests/sglang_real/sglang_suite.py (`make test-sglang`, opt-in).
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from specdec.engine.engine import Engine
from specdec.engine.layout import SeqInput
from specdec.engine.registry import load


class FakeScorer:
    def __init__(self, model: str = "tiny-llama"):
        self.lm = load(model)
        self.engine = Engine(self.lm.model, kv_tokens=4096)
        self.lock = threading.Lock()
        self.calls: list[dict] = []
        self.down = False
        scorer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if scorer.down:
                    return self._send(503, {"error": "down"})
                if self.path == "/health":
                    return self._send(200, {})
                if self.path == "/model_info":
                    return self._send(200, {"model_path": model, "is_generation": True})
                self._send(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if scorer.down:
                    return self._send(503, {"error": "down"})
                if self.path == "/tokenize":
                    return self._send(200, {"tokens": scorer.lm.tokenizer.encode(body["prompt"])})
                if self.path == "/generate":
                    scorer.calls.append(body)
                    return self._send(200, scorer.generate(body))
                self._send(404, {})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def logprob_rows(self, ids: list[int]) -> torch.Tensor:
        """log-softmax of the logits of every position of `ids` [len(ids), V], float64."""
        with self.lock:
            seq = self.engine.new_sequence()
            try:
                out = self.engine.forward([SeqInput(seq, ids, start=0, logits="all")])
                return torch.log_softmax(out.rows(0).double(), -1)
            finally:
                self.engine.release(seq)

    def generate(self, body: dict):
        batch = isinstance(body["input_ids"][0], list)
        items = body["input_ids"] if batch else [body["input_ids"]]
        n = len(items)

        def per(name, default=None):
            v = body.get(name, default)
            return v if isinstance(v, list) and (name != "token_ids_logprob") else [v] * n

        starts, ks = per("logprob_start_len", -1), per("top_logprobs_num", 0)
        out = []
        for ids, start, k in zip(items, starts, ks):
            lp = self.logprob_rows(ids)

            def top(row):
                v, i = torch.sort(row, descending=True, stable=True)
                return [[float(a), int(b), None] for a, b in zip(v[:k], i[:k])]
            start = max(start, 0)
            inp = [None] + [top(lp[p - 1]) for p in range(start + 1, len(ids))]
            out.append({"text": "", "output_ids": [int(lp[-1].argmax())],
                        "meta_info": {"input_top_logprobs": inp, "output_top_logprobs": [top(lp[-1])],
                                      "cached_tokens": 0, "prompt_tokens": len(ids)}})
        return out if batch else out[0]
