"""One thread for all of a server process's torch work (model load, prefill, steps, drafting).

PyTorch's CPU kernels run on OpenMP (libgomp), which gives every thread that enters a parallel region a team of
worker threads of its own. While a process's OpenMP threads fit its cores, a team's workers spin between regions and
a decode step's ~1,500 short regions start at once; once two threads have teams (e.g. the model loaded on the main
thread, steps on asyncio.to_thread's rotating workers), libgomp finds more threads than cores, stops spinning, and
every region pays a wake-up. Measured on 2 cores (SmolLM2 bf16 decode step, same engine): 39 ms when one thread does
all torch work, 70-78 ms from a second thread, and the first thread stayed slow too; served through REST, a plain
decode step took 72 ms before this module and 45 ms after it. So servers run torch on this one thread, through `run`
(async) or `call` (from any thread; on this one it runs inline).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import functools
import gc
import threading

_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")
_THREAD = _pool.submit(threading.get_ident).result()     # the pool's one thread, started here


def on_compute_thread() -> bool:
    return threading.get_ident() == _THREAD


async def run(fn, *args, **kwargs):
    """await fn(*args, **kwargs) on the compute thread (calls queue behind each other, in order)."""
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args, **kwargs))


def call(fn, *args, **kwargs):
    """fn(*args, **kwargs) on the compute thread, from any other thread (on it: directly, not to deadlock)."""
    if on_compute_thread():
        return fn(*args, **kwargs)
    return _pool.submit(fn, *args, **kwargs).result()


def settle_heap() -> int:
    """Once a server has loaded and warmed up: collect, then move every object start-up made into the permanent
    generation (gc.freeze), so the collector's full passes no longer walk them. The target holds ~330k tracked objects
    after loading SmolLM2 (tokenizer, modules, registries); a full collection of them took 98 ms, holding the GIL,
    so a step in flight stalled whenever one came. Returns the objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def keep_freed_memory(threshold: int = 1 << 30) -> bool:
    """Stop glibc giving freed heap memory back to the kernel until `threshold` bytes of it are free (M_TRIM_THRESHOLD;
    glibc's starts at 128 kB): a step frees its activations, the heap's top is trimmed, and the next step faults the
    same memory back in page by page (a few us a page on these VMs). Measured, the block drafter drafting 32 requests at
    once: 84 -> 21 ms (8 requests: 5.1 -> 4.5 ms); the target's verify forwards did not change. The process keeps its
    peak heap. False where the C library has no mallopt (not glibc)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(-1, threshold))      # -1: M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        return False
