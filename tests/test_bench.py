"""The benchmark harness on tiny models in process: every figure present and the arithmetic consistent."""
import json
import subprocess
import sys

import pytest

from specdec.bench.report import RequestRecord, StepRecord, alpha_token, leviathan_gain, summarize

FIELDS = ["requests", "tokens", "wall_s", "tokens_per_s", "decode_tokens_per_s", "steps", "alpha", "alpha_token", "AL",
          "per_position_acceptance", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "draft_ms_per_step",
          "verify_ms_per_step", "c", "r", "bound", "speedup", "efficiency", "bound_al", "eff_al", "gamma"]


def test_summarize_arithmetic():
    reqs = [RequestRecord(tokens=30, steps=10, drafted=40, accepted=20, drafted_per_pos=[10, 10, 10, 10],
                          accepted_per_pos=[8, 6, 4, 2], ttft_s=0.1, itl_s=[0.01] * 29)]
    steps = [StepRecord(draft_ms=4.0, verify_ms=20.0, other_ms=1.0, rows=5)] * 10
    base = {"tokens_per_s": 40.0, "verify_ms_per_step": 20.0, "other_ms_per_step": 0.5}
    s = summarize(reqs, steps, wall_s=0.5, gamma=4, baseline=base)
    assert s["alpha"] == 0.5 and s["AL"] == 3.0 and s["tokens_per_s"] == 60.0 and s["speedup"] == 1.5
    assert s["per_position_acceptance"] == [0.8, 0.6, 0.4, 0.2]
    assert s["decode_tokens_per_s"] == pytest.approx(29 / 0.29)                     # prefill (ttft) left out
    assert s["alpha_token"] == pytest.approx((0.8 + 0.75 + 4 / 6 + 0.5) / 4)
    assert s["c"] == pytest.approx(4.0 / 4 / 20.0) and s["r"] == pytest.approx(0.5 / 20.0)
    assert s["bound"] == pytest.approx(leviathan_gain(s["alpha_token"], 4) / (1 + 4 * s["c"] + s["r"]))
    assert s["efficiency"] == pytest.approx(1.5 / s["bound"])
    assert s["bound_al"] == pytest.approx(3.0 / (1 + 4 * s["c"] + s["r"]))      # measured AL in place of E(gamma)
    assert s["eff_al"] == pytest.approx(1.5 / s["bound_al"])
    assert leviathan_gain(0.5, 2) == pytest.approx(1.75)
    assert alpha_token([0.5, 0.25, 0.125]) == pytest.approx(0.5)   # iid: a_j = alpha^j


def test_bound_al_holds_where_blocks_end_early():
    """A run that costs exactly what the Leviathan model charges (a verify = one target step, no overhead) but whose
    blocks end early (4 slots asked, most steps drafted 1): eff_al is 1; the whole-block bound counts slots no step
    drafted (alpha_token from the few long blocks, all accepted) and puts efficiency far below."""
    reqs = [RequestRecord(tokens=21, steps=10, drafted=16, accepted=11, drafted_per_pos=[10, 2, 2, 2],
                          accepted_per_pos=[5, 2, 2, 2])]
    steps = [StepRecord(draft_ms=4.0, verify_ms=20.0, other_ms=0.0, rows=2)] * 10
    base = {"tokens_per_s": 50.0, "verify_ms_per_step": 20.0, "other_ms_per_step": 0.0}
    s = summarize(reqs, steps, wall_s=0.24, gamma=4, baseline=base)
    assert s["AL"] == pytest.approx(2.1) and s["speedup"] == pytest.approx(1.75)
    assert s["eff_al"] == pytest.approx(1.0) and s["decode_speedup"] is None      # no decode figures: end to end
    reqs[0].itl_s = [0.012] * 20                            # with decode figures: the decode speedup
    s = summarize(reqs, steps, wall_s=0.24, gamma=4, baseline={**base, "decode_tokens_per_s": 40.0})
    assert s["decode_speedup"] == pytest.approx(20 / 0.24 / 40.0)
    assert s["eff_al"] == pytest.approx(s["decode_speedup"] / s["bound_al"])
    assert s["bound"] == pytest.approx(5 / 1.2) and s["efficiency"] == pytest.approx(0.42)


def test_served_bench_alternates_the_order_of_its_runs():
    """bench --url: each part of the prompts runs under every configuration, baseline first on even parts and last
    on odd ones, and each configuration's figures add up its parts (the runner here only records what it was asked:
    the order is the point; the real runs go through a live stack)."""
    import argparse

    from specdec.bench.main import bench_rest
    from specdec.speculative.sampling import SamplingParams
    calls = []

    def runner(url, chunk, *, max_tokens, concurrency, params, speculative, desc):
        calls.append((None if speculative is None else speculative["gamma"], [it["prompt"] for it in chunk]))
        n = len(chunk)
        return ([RequestRecord(10, 5 if speculative else 10, 0, 0, [], []) for _ in chunk],
                [StepRecord(1.0, 2.0, 0.5, 4)] * n, 0.1 * n if speculative else 0.2 * n)

    items = [{"prompt": f"p{i}"} for i in range(6)]
    args = argparse.Namespace(url="http://x", max_tokens=8, concurrency=2, acceptance=None, rounds=2)
    res = bench_rest(runner, args, items, SamplingParams(), [4, 2])
    assert [g for g, _ in calls] == [None, 4, 2, 2, 4, None]
    assert [c for _, c in calls] == [["p0", "p1", "p2"]] * 3 + [["p3", "p4", "p5"]] * 3
    base, spec = res["baseline (speculation off)"], res["speculative gamma=4"]
    assert base["requests"] == spec["requests"] == 6 and base["wall_s"] == pytest.approx(1.2)
    assert spec["speedup"] == pytest.approx(2.0)
    args.rounds = 1
    calls.clear()
    bench_rest(runner, args, items, SamplingParams(), [4])
    assert [g for g, _ in calls] == [None, 4] and calls[0][1] == [f"p{i}" for i in range(6)]
    # a part holds at least --concurrency prompts, else the run never has that many requests in flight
    args.rounds, args.concurrency = 2, 3
    calls.clear()
    bench_rest(runner, args, items, SamplingParams(), [4])
    assert [len(c) for _, c in calls] == [3, 3, 3, 3]
    args.concurrency = 4
    calls.clear()
    bench_rest(runner, args, items, SamplingParams(), [4])
    assert [len(c) for _, c in calls] == [6, 6]


def test_bench_in_process_json(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--target", "tiny-llama", "--draft",
                        "tiny-llama-draft", "-n", "4", "--max-tokens", "16", "--gamma", "2,3", "--concurrency", "2",
                        "--draft-min-conf", "0,0.99", "--ignore-eos", "--out", str(out),
                        "--plot", str(tmp_path / "plots")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert set(runs) == {"baseline (speculation off)"} | {f"tiny-llama-draft min_conf={c} gamma={g}"
                                                          for c in ("0", "0.99") for g in (2, 3)}
    # the tiny draft is never 99% sure of a token: every block ends at its first slot
    sure, whole = runs["tiny-llama-draft min_conf=0.99 gamma=3"], runs["tiny-llama-draft min_conf=0 gamma=3"]
    assert sure["drafted"] < whole["drafted"]
    base = runs["baseline (speculation off)"]
    assert base["tokens"] == 4 * 16 and base["AL"] == 1.0
    for name, s in runs.items():
        if name.startswith("baseline"):
            continue
        for f in FIELDS:
            assert f in s and s[f] is not None, (name, f)
        assert s["tokens"] == 4 * 16
        assert s["alpha"] == pytest.approx(s["accepted"] / s["drafted"])
        assert s["AL"] == pytest.approx(s["tokens"] / s["request_steps"])
        assert s["speedup"] == pytest.approx(s["tokens_per_s"] / base["tokens_per_s"])
        assert s["bound"] == pytest.approx(leviathan_gain(s["alpha_token"], s["gamma"]) /
                                           (1 + s["gamma"] * s["c"] + max(0.0, s["r"])))
        assert s["efficiency"] == pytest.approx(s["speedup"] / s["bound"])
        assert 1.0 < s["AL"] <= s["gamma"] + 1 or "0.99" in name
    assert {p.name for p in (tmp_path / "plots").iterdir()} == {"acceptance_per_position.png", "latency_cdf.png",
                                                                 "speedup_vs_gamma.png"}
    assert "tokens_p" in r.stdout and "speedup" in r.stdout


def test_trace_summarize(tmp_path):
    trace = tmp_path / "t.jsonl"
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", "tiny-llama", "--draft",
                        "tiny-llama-draft", "--gamma", "3", "--prompt", "hello there", "--max-tokens", "30",
                        "--trace", str(trace)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    al = float(r.stderr.split("AL ")[1].split()[0])
    s = subprocess.run([sys.executable, "-m", "specdec.cli", "trace", "summarize", str(trace)],
                       capture_output=True, text=True, timeout=120)
    assert s.returncode == 0, s.stderr
    got = {line.split(":")[0].strip(): line.split(":", 1)[1].strip() for line in s.stdout.splitlines()}
    assert float(got["AL"]) == pytest.approx(al, abs=0.01)
    recs = [json.loads(x) for x in trace.read_text().splitlines()]
    assert float(got["alpha"]) == pytest.approx(sum(x["accepted"] for x in recs) /
                                                sum(x["verify_len"] - 1 for x in recs), abs=1e-3)


def test_no_batch_invariant_flag(tmp_path):
    """`--no-batch-invariant` reaches `specdec generate` and `specdec bench` (target and model drafter engines)."""
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "--model", "tiny-llama", "--draft",
                        "tiny-llama-draft", "--no-batch-invariant", "--prompt", "hi", "--max-tokens", "6"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "specdec.cli", "bench", "--target", "tiny-llama", "--draft",
                        "tiny-llama-draft", "--no-batch-invariant", "-n", "1", "--max-tokens", "6", "--gamma", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["args"]["batch_invariant"] is False
