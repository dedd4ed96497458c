"""Tensor memory of a process on the CPU: the bytes its live tensors hold, and the peak a
step adds on top of them.

What it is for: the per-rank figure that corresponds to a GPU's device memory. The peak
resident-set growth that benchmarks/measure_torchtitan.py also reports counts the Python
heap, the allocator's arenas and the build's leftovers with the tensors, and at a small
model's size (12.5 MiB of weights) those move a row by 5-10 MiB. On a GPU only tensors
live in device memory.

How:
- `live_tensor_bytes`: every distinct CPU storage held by a tensor the garbage collector
  tracks (parameters, a DTensor's local shard, optimizer state, gradient sums), each
  counted once however many tensors view it;
- `step_peak_bytes`: the highest sum of the bytes a call allocated and has not yet freed,
  from torch.profiler's memory events (`profile_memory=True`: each allocation and free of
  the CPU allocator, with its address). A free of a tensor allocated before the call is
  not subtracted (its size is unknown to the profiler), so a step that replaces a live
  tensor counts both: the figure is an upper bound by at most what the step frees of the
  older tensors before its peak, on both programs alike.
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from typing import Callable


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages held by the tensors the garbage collector tracks."""
    import torch

    sizes: dict[int, int] = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor):
            continue
        try:
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass (DTensor), fake or sparse
            continue
        if ptr and storage.device.type == "cpu":
            sizes[ptr] = max(sizes.get(ptr, 0), storage.nbytes())
    return sum(sizes.values())


def step_peak_bytes(run: Callable[[], object]) -> int:
    """The peak of the bytes `run()` allocates and has not freed yet (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.unlink(path)
    live: dict[int, int] = {}
    current = peak = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        nbytes, addr = e["args"]["Bytes"], e["args"]["Addr"]
        if nbytes > 0:
            live[addr] = live.get(addr, 0) + nbytes
            current += nbytes
            peak = max(peak, current)
        elif addr in live:
            current -= live.pop(addr)
    return peak
