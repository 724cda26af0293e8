"""bench.idle_probe's accounting: GPU idle time charged to the innermost engine method the host was in."""

from types import SimpleNamespace

import torch

from bench.idle_probe import idle_by_label

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def _event(name, device, start, end):
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=device, time_range=span)


def test_idle_time_goes_to_the_innermost_method():
    # A pass of 10,000 us: a step (0-9,000) holding a prefill (1,000-3,000) and a commit (6,000-8,000).
    # Kernels run 1,500-3,000 (inside the prefill) and 8,000-10,000.
    events = [_event("step", CPU, 0, 9000), _event("prefill", CPU, 1000, 3000), _event("commit", CPU, 6000, 8000),
              _event("kernel", CUDA, 1500, 3000), _event("kernel", CUDA, 8000, 10000)]
    got = idle_by_label(events, 0, 10000)
    assert got["kernels"] == 2
    assert got["busy_ms"] == 3.5 and got["idle_ms"] == 6.5  # one-us bins to 10,000 inclusive: the last, idle, rounds away
    by = got["idle_ms_by"]
    assert by["prefill"] == 0.5  # 1,000-1,500 idle inside the prefill
    assert by["commit"] == 2.0
    assert by["step"] == 4.0  # 0-1,000 and 3,000-6,000
    assert by["caller"] == 0.0 and by["round"] == 0.0
    assert got["prefill_wall_ms"] == 2.0 and got["prefill_busy_ms"] == 1.5
