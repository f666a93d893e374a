"""What the PD test processes (pd_proc.py, tp_proc.py) share: SGLang's real aux rows filled from a
seed, their tensors in the backend's order, a bounded wait for a sender's or receiver's state, and
progress as one JSON object per line."""

from __future__ import annotations

import json
import time

#: seconds a process waits for a room's state before it gives up
BOUND = 60.0


def say(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def aux_buffers(seed: int):
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    m = MetadataBuffers(8, 64, torch.bfloat16, 0)
    g = torch.Generator().manual_seed(seed)
    for t in aux_tensors(m):
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
    return m


def aux_tensors(m) -> list:
    import torch

    ptrs, _lens, _items = m.get_buf_infos()
    found = [v for v in vars(m).values() if isinstance(v, torch.Tensor) and v.data_ptr() in ptrs]
    return sorted(found, key=lambda t: ptrs.index(t.data_ptr()))


def wait_for(poll, states, what: str):
    t0 = time.monotonic()
    while time.monotonic() - t0 < BOUND:
        s = poll()
        if s in states:
            return s, time.monotonic() - t0
        time.sleep(0.01)
    raise TimeoutError(f"{what}: no state in {states} after {BOUND}s")
