"""The CUDA plugin's peer-memory all-reduce, on the CPU: which ranks may use it (every rank agrees,
or none uses it), which all-reduces it takes, and that everything else goes to the wrapped
communicator. The kernel itself runs in tests/test_peer_memory_gpu.py (two GPUs)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import torchhal
from torchhal.distributed import CollectiveError, TorchCommunicator
from torchhal.plugins import cuda_collectives
from torchhal.plugins.cuda_collectives import PeerMemoryCommunicator, peer_memory_communicator, why_not

HOST = ["node-a", "node-a"]
DEVICES = ["GPU-0", "GPU-1"]


@pytest.fixture
def two_visible_devices(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[int, int], bool]:
    """torch.cuda as a host of two devices with these UUIDs; the dict says which pairs reach each other."""
    reach = {(0, 1): True, (1, 0): True}

    class Properties:
        def __init__(self, index: int) -> None:
            self.uuid = DEVICES[index]

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: Properties(int(index)))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: reach[(a, b)])
    monkeypatch.delenv(cuda_collectives.OFF_SWITCH, raising=False)
    return reach


# -- who may use it ------------------------------------------------------------------------------
def test_two_ranks_on_one_host_reaching_each_other_may(two_visible_devices: Any) -> None:
    assert why_not(0, HOST, DEVICES) == why_not(1, HOST, DEVICES) == ""


def test_each_reason_not_to_is_named(two_visible_devices: dict[tuple[int, int], bool],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert "more than one host" in why_not(0, ["node-a", "node-b"], DEVICES)
    assert "groups of (2, 4, 8), not 3" in why_not(0, HOST + ["node-a"], DEVICES + ["GPU-0"])
    assert "GPU-7" in why_not(0, HOST, ["GPU-0", "GPU-7"])  # the peer's device is not visible here
    two_visible_devices[(0, 1)] = False
    assert why_not(0, HOST, DEVICES) == "device 0 cannot reach device 1's memory"
    assert why_not(1, HOST, DEVICES) == ""  # only the rank that cannot reach says so
    monkeypatch.setenv(cuda_collectives.OFF_SWITCH, "0")
    assert why_not(1, HOST, DEVICES) == "TORCHHAL_CUDA_PEER_ALL_REDUCE=0"


def ranks_agree(monkeypatch: pytest.MonkeyPatch, hosts: list[str], failing_rank: int | None = None) -> list[Any]:
    """peer_memory_communicator on two ranks (threads) over one store; what each got.
    `failing_rank`: that rank's PeerMemoryCommunicator raises while mapping its buffer."""
    built: list[int] = []

    class Recorded:
        def __init__(self, inner: TorchCommunicator) -> None:
            if inner.rank == failing_rank:
                raise RuntimeError("CUDA driver error: operation not permitted when sharing a handle")
            built.append(inner.rank)

    monkeypatch.setattr(cuda_collectives, "PeerMemoryCommunicator", Recorded)
    monkeypatch.setattr(cuda_collectives.socket, "gethostname", lambda: hosts[int(threading.current_thread().name)])
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=10))
    defaults = [TorchCommunicator(object(), rank, 2, torch.device("cuda", rank), store=store) for rank in (0, 1)]
    got: list[Any] = [None, None]

    def rank(index: int) -> None:
        got[index] = peer_memory_communicator(defaults[index])

    threads = [threading.Thread(target=rank, args=(i,), name=str(i)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert all(r in built for r, g in enumerate(got) if not isinstance(g, TorchCommunicator))
    return [g if isinstance(g, TorchCommunicator) else "peer" for g in got]


def test_ranks_that_all_can_wrap_their_communicators(two_visible_devices: Any, monkeypatch: pytest.MonkeyPatch):
    assert ranks_agree(monkeypatch, HOST) == ["peer", "peer"]


def test_one_rank_that_cannot_keeps_every_rank_on_the_default(two_visible_devices: dict[tuple[int, int], bool],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 reaches rank 1's device, rank 1 does not reach rank 0's: a rank deciding alone would
    # use peer memory on rank 0 and NCCL on rank 1, and the two would wait on different collectives.
    two_visible_devices[(1, 0)] = False
    got = ranks_agree(monkeypatch, HOST)
    assert all(isinstance(g, TorchCommunicator) for g in got), got
    assert all(isinstance(g, TorchCommunicator) for g in ranks_agree(monkeypatch, ["node-a", "node-b"]))


def test_a_rank_that_fails_to_map_its_buffer_keeps_every_rank_on_the_default(two_visible_devices: Any,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 builds its peer-memory communicator, rank 1's raises: rank 0 alone on peer memory
    # would wait at a barrier rank 1 never reaches.
    with pytest.warns(torchhal.TorchhalPluginWarning, match=r"stay on NCCL; .*rank 1: RuntimeError: CUDA driver"):
        got = ranks_agree(monkeypatch, HOST, failing_rank=1)
    assert all(isinstance(g, TorchCommunicator) for g in got), got


def test_a_group_without_a_store_or_of_one_rank_keeps_the_default() -> None:
    alone = TorchCommunicator(object(), 0, 1, torch.device("cuda", 0), store=dist.HashStore())
    storeless = TorchCommunicator(object(), 0, 2, torch.device("cuda", 0))
    assert peer_memory_communicator(alone) is alone
    assert peer_memory_communicator(storeless) is storeless


# -- which all-reduces it takes ------------------------------------------------------------------
class Recorder(TorchCommunicator):
    """The wrapped communicator: records the calls that reach it."""

    def __init__(self) -> None:
        super().__init__(object(), 0, 2, torch.device("cpu"), name="test")
        self.calls: list[tuple[str, Any]] = []

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.calls.append(("all_reduce", op))
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0, sizes: Any = None) -> torch.Tensor:
        self.calls.append(("all_gather", dim))
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.calls.append(("broadcast", src))
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.calls.append(("send", dst))

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.calls.append(("recv", src))
        return tensor


@pytest.fixture
def wrapped(monkeypatch: pytest.MonkeyPatch) -> tuple[PeerMemoryCommunicator, Recorder, list[Any]]:
    """A PeerMemoryCommunicator on the CPU device around a Recorder; the kernel replaced by a
    recorder that doubles the tensor (two ranks holding the same values)."""
    inner = Recorder()
    comm = object.__new__(PeerMemoryCommunicator)
    comm.inner, comm.rank, comm.world_size = inner, 0, 2
    comm.device, comm.graph_capturable, comm.capacity = torch.device("cpu"), True, 4096
    comm.group_name, comm.buffer = "torchhal-test", torch.zeros(4096, dtype=torch.uint8)
    kernels: list[Any] = []

    def one_shot(staged: torch.Tensor, tensor: torch.Tensor, group_name: str) -> None:
        kernels.append((staged, tensor, group_name))
        tensor.mul_(2)

    monkeypatch.setattr(cuda_collectives, "one_shot_sum", one_shot)
    return comm, inner, kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_small_aligned_sum_goes_through_peer_memory_in_place(wrapped: Any, dtype: torch.dtype) -> None:
    comm, inner, kernels = wrapped
    tensor = torch.arange(64, dtype=dtype).reshape(8, 8)
    assert comm.all_reduce(tensor) is tensor
    assert torch.equal(tensor, (torch.arange(64, dtype=dtype) * 2).reshape(8, 8)) and inner.calls == []
    (staged, flat, name), = kernels
    assert staged.dtype == dtype and staged.numel() == 64 and name == "torchhal-test"
    assert staged.untyped_storage().data_ptr() == comm.buffer.untyped_storage().data_ptr()  # the peer buffer
    assert flat.data_ptr() == tensor.data_ptr() and flat.shape == (64,)


@pytest.mark.parametrize("layout", ["strided", "offset", "storage offset"])
def test_a_sum_laid_out_otherwise_still_goes_through_peer_memory_by_a_copy(wrapped: Any, layout: str) -> None:
    """Routed by reduction, dtype and size alone: a rank whose tensor is a view must meet its
    peers in the same collective as one whose tensor is dense (else one waits in NCCL, the
    other at the peer barrier). The kernel gets a dense aligned copy; the view gets the sum."""
    comm, inner, kernels = wrapped
    storage = torch.arange(40.0)
    if layout == "storage offset":  # a storage that itself starts 4 bytes past 16: storage_offset() is 0
        storage = torch.frombuffer(bytearray(164), dtype=torch.float32, offset=4, count=40).copy_(storage)
        assert storage.storage_offset() == 0 and storage.data_ptr() % 16 != 0
    tensor = {"strided": storage.view(20, 2)[2:18, 0], "offset": storage[1:17]}.get(layout, storage[:16])
    expected = tensor * 2
    assert comm.takes(tensor, "sum") == comm.takes(tensor.contiguous(), "sum") is True
    assert comm.all_reduce(tensor) is tensor
    assert torch.equal(tensor, expected) and inner.calls == []
    (_, flat, _), = kernels
    assert flat.is_contiguous() and flat.data_ptr() % 16 == 0 and flat.data_ptr() != tensor.data_ptr()
    changed = (storage != torch.arange(40.0)).nonzero().flatten().tolist()  # offsets into `storage`
    view_offsets = [tensor.storage_offset() + i * tensor.stride(0) for i in range(tensor.numel())]
    assert set(changed) <= set(view_offsets)  # nothing but the view's elements changed


@pytest.mark.parametrize("case", ["max", "min", "float16", "int64", "too big", "odd bytes", "empty"])
def test_every_other_all_reduce_goes_to_the_wrapped_communicator(wrapped: Any, case: str) -> None:
    comm, inner, kernels = wrapped
    tensor, op = torch.ones(16), "sum"
    if case in ("max", "min"):
        op = case
    elif case in ("float16", "int64"):
        tensor = tensor.to(getattr(torch, case))
    elif case == "too big":
        tensor = torch.ones(comm.capacity // 4 + 4)
    elif case == "odd bytes":
        tensor = torch.ones(3)
    elif case == "empty":
        tensor = torch.ones(0)
    assert comm.all_reduce(tensor, op) is tensor
    assert inner.calls == [("all_reduce", op)] and kernels == []


def test_the_other_collectives_are_the_wrapped_communicators(wrapped: Any) -> None:
    comm, inner, kernels = wrapped
    t = torch.ones(4)
    comm.all_gather(t, 0)
    comm.broadcast(t, 1)
    comm.send(t, 1)
    comm.recv(t, 1)
    assert inner.calls == [("all_gather", 0), ("broadcast", 1), ("send", 1), ("recv", 1)] and kernels == []


def test_a_closed_group_refuses_the_peer_path_too(wrapped: Any) -> None:
    comm, inner, kernels = wrapped
    inner.backend = None  # DeviceGroup.close drops the backends
    tensor = torch.ones(16)
    with pytest.raises(CollectiveError, match="is closed"):
        comm.all_reduce(tensor)
    assert kernels == [] and torch.equal(tensor, torch.ones(16))
