"""The backend test and the default device: NCCL (also inside a mixed backend) means the current CUDA device,
anything else the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from duplexpipe.runtime.backend import default_device, is_nccl


@pytest.mark.parametrize("name, nccl", [("gloo", False), ("nccl", True), ("cpu:gloo,cuda:nccl", True),
                                        ("mpi", False)])
def test_is_nccl_reads_the_groups_backend(monkeypatch: pytest.MonkeyPatch, name: str, nccl: bool) -> None:
    asked: list[object] = []
    group = object()

    def backend(g: object = None) -> str:
        asked.append(g)
        return name

    monkeypatch.setattr(dist, "get_backend", backend)
    assert is_nccl(group) is nccl and asked == [group]


def test_default_device_is_the_cpu_before_init_and_on_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert default_device() == torch.device("cpu")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert default_device() == torch.device("cpu")


def test_default_device_under_nccl_is_the_current_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert default_device() == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # NCCL's name without CUDA: the CPU
    assert default_device() == torch.device("cpu")
