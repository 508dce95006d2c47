"""All of a server's torch work runs on one thread (specdec/compute.py): OpenMP gives every thread that enters a
parallel region its own team, and with more OpenMP threads than cores every region pays a wake-up (measured on 2
cores: a decode step from a second thread took 70 ms against 39 ms)."""
from __future__ import annotations

import asyncio
import threading

from specdec import compute
from specdec.engine.registry import load

from .test_fault_isolation import Stack


def test_run_and_call_use_one_thread():
    seen = []
    record = lambda: seen.append(threading.get_ident())  # noqa: E731

    async def main():
        await compute.run(record)
        await asyncio.gather(*[compute.run(record) for _ in range(8)])
        await asyncio.to_thread(compute.call, record)                      # from another thread
        await compute.run(compute.call, record)                            # from the compute thread: inline
    asyncio.run(main())
    compute.call(record)
    assert len(seen) == 12 and len(set(seen)) == 1 and seen[0] != threading.get_ident()
    assert compute.call(compute.on_compute_thread) and not compute.on_compute_thread()


def test_scheduler_runs_every_forward_on_the_compute_thread():
    """Prefill, speculative steps (drafts verified) and plain steps of concurrent requests through the in-process
    stack: every engine forward ran on the compute thread (the scheduler used to hand steps to asyncio.to_thread's
    rotating workers)."""
    lm = load("tiny-llama")
    threads = []

    async def run():
        async with Stack(lm) as s:
            s.engine.fail = lambda inputs: threads.append(compute.on_compute_thread()) and False
            bodies = [{"prompt": p, "max_tokens": 12, "temperature": t, "seed": 3,
                       "speculative": {"enabled": e}} for p, t, e in
                      (("abc", 0.0, True), ("hello", 0.8, True), ("xyz", 0.0, False))]
            rs = await asyncio.gather(*[s.http.post("/v1/completions", json=b) for b in bodies])
            return [r.status_code for r in rs]

    assert asyncio.run(run()) == [200, 200, 200]
    assert len(threads) > 3 and all(threads)


def test_freed_heap_memory_is_kept_for_the_next_step(tmp_path):
    """keep_freed_memory: 100 MB of 100 kB blocks freed stay in the process (the next step reuses them without
    faulting pages in); without it glibc gives them back to the kernel at once. In a fresh process each way."""
    import platform
    import subprocess
    import sys
    if platform.libc_ver()[0] != "glibc":
        import pytest
        pytest.skip("mallopt(M_TRIM_THRESHOLD) is glibc's")
    script = tmp_path / "heap.py"
    script.write_text(
        "import sys\n"
        "from specdec.compute import keep_freed_memory\n"
        "if sys.argv[1] == '1':\n"
        "    assert keep_freed_memory()\n"
        "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "blocks = [bytearray(b'x' * 100_000) for _ in range(1000)]\n"
        "before = rss()\n"
        "del blocks\n"
        "print((before - rss()) / 2 ** 20)\n")
    given_back = {k: float(subprocess.run([sys.executable, str(script), k], capture_output=True, text=True,
                                          check=True).stdout) for k in ("0", "1")}
    assert given_back["0"] > 50 and given_back["1"] < 5, given_back


def test_settle_heap_takes_start_up_objects_out_of_full_collections():
    """settle_heap (called by both servers before serving): what exists then is frozen, so a full collection, which
    the collector runs on the compute thread's GIL in the middle of a step, no longer walks it (98 ms for the
    target's ~330k objects); objects made later are collected as before."""
    import gc
    from specdec.compute import settle_heap
    loaded = [{"i": i} for i in range(50_000)]          # a loaded model's many small objects
    try:
        frozen = settle_heap()
        # what it froze, less any frozen object another thread freed since (pytest-xdist's I/O thread: 2 of ~600k
        # in one run); nothing but gc.freeze adds to the count
        assert frozen >= 50_000 and frozen - 100 <= gc.get_freeze_count() <= frozen
        assert not any(o is loaded for o in gc.get_objects(generation=2))
        import weakref

        class Node:
            pass
        later = Node()
        later.me = later                                # a cycle made after start-up is still collected
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None
    finally:
        gc.unfreeze()
