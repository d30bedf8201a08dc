import dataclasses
import multiprocessing as mp

import pytest
import torch

import torchhal
from torchhal.platforms import IpcHandleError


def _consume(handle, queue):
    platform = torchhal.get_platform("cpu")
    tensor = platform.ipc_support.open(handle, 0)
    queue.put((tensor.tolist(), tensor.device.type))  # plain data: the child may exit first


def share(tensor):
    return torchhal.get_platform("cpu").ipc_support.share(tensor)


def test_round_trip_across_a_spawned_process():
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    view = base[2:, 1::2]  # offset and non-contiguous stride
    handle = share(view)
    assert handle.offset_bytes == (2 * 8 + 1) * 4 and handle.stride == (8, 2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_consume, args=(handle, queue))
    proc.start()
    got, device_type = queue.get(timeout=60)
    proc.join(timeout=60)
    assert device_type == "cpu"
    assert got == view.tolist()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"offset_bytes": 10_000}, "reaches byte"),
        ({"shape": (100, 100)}, "reaches byte"),
        ({"dtype": "float128"}, "unknown dtype 'float128'"),
        ({"shape": (-1, 4)}, r"shape\[0\] = -1"),
        ({"shape": (2**60, 2)}, "shape"),
        ({"offset_bytes": 2}, "not a multiple"),
        ({"storage_nbytes": 10**9}, "reaches byte|holds"),
        ({"stride": (4,)}, "differ in length"),
        ({"storage": (b"/tmp/x", b"/../etc/passwd")}, "is not torch's"),
        ({"storage": (b"/tmp/torch-shm-dir-abcdef/manager.sock", b"/../etc/passwd")}, "is not torch's"),
        ({"name": b"/torch_1_2_3"}, "shared memory '/dev/shm/torch_1_2_3' no longer exists"),
        ({"manager": b"/tmp/torch-shm-dir-abcdef/manager.sock"}, "manager socket .* no longer exists"),
    ],
)
def test_malformed_handles_are_rejected(change, message):
    tensor = torch.zeros(4, 4)
    handle = share(tensor)
    manager, name = handle.storage
    if "name" in change or "manager" in change:  # torch's own form, naming an object that is not there
        change = {"storage": (change.get("manager", manager), change.get("name", name))}
    bad = dataclasses.replace(handle, **change)
    if "storage_nbytes" in change:
        bad = dataclasses.replace(bad, shape=(10**4, 4), stride=(4, 1))
    with pytest.raises(IpcHandleError, match=message):
        torchhal.get_platform("cpu").ipc_support.open(bad, 0)


def test_a_vendor_platform_built_on_the_cpu_one_names_itself_in_its_handles(make_registry):
    from torchhal.platforms import hookimpl
    from torchhal.plugins.cpu import CpuPlatform

    class AcmePlatform(CpuPlatform):
        name = "acme"
        priority = 7

    class Registration:
        @hookimpl
        def torchhal_register_platforms(self):
            return [AcmePlatform()]

    make_registry(Registration())
    acme, cpu = torchhal.get_platform("acme").ipc_support, torchhal.get_platform("cpu").ipc_support
    tensor = torch.arange(6.0)
    handle = acme.share(tensor)
    assert handle.platform == "acme"  # the producing platform's name, as the SPI says
    assert acme.open(handle, 0).tolist() == tensor.tolist()
    with pytest.raises(IpcHandleError, match="acme IPC opens acme handles of device 0 on device 0; got 'cpu'"):
        acme.open(cpu.share(tensor), 0)
    with pytest.raises(IpcHandleError, match="cpu IPC opens cpu handles of device 0 on device 0; got 'acme'"):
        cpu.open(handle, 0)
