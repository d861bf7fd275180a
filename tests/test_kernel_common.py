"""epbench/backends/kernel_common.py on the CPU: the shared poison and collective release."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from epbench.backends import kernel_common


def test_poison_fills_every_dispatch_output():
    be = SimpleNamespace(recv_x=torch.zeros(4, 8, dtype=torch.bfloat16), recv_scales=torch.zeros(4, 1),
                         recv_idx=torch.zeros(4, 2, dtype=torch.int64), recv_w=torch.zeros(4, 2),
                         expert_counts=torch.zeros(3, dtype=torch.int64), num_recv=torch.zeros((), dtype=torch.int64),
                         out=torch.zeros(2, 8, dtype=torch.bfloat16))
    kernel_common.poison_dispatch_outputs(be)
    assert bool((be.recv_x.view(torch.uint8) == 0xFF).all())
    assert bool(be.recv_scales.isnan().all() and be.recv_w.isnan().all() and be.out.isnan().all())
    assert bool((be.recv_idx == -1).all() and (be.expert_counts == -1).all()) and int(be.num_recv) == -1
    be.recv_scales = None  # bf16 backends have no scales
    kernel_common.poison_dispatch_outputs(be)


def test_release_waits_for_the_device_then_destroys(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: calls.append(("sync", device)))
    kernel_common.release_collective(torch.device("cuda", 1), 1, lambda: calls.append("destroy"))
    assert calls == [("sync", torch.device("cuda", 1)), "destroy"]
