"""Mapping tests: each vendor plugin against a fake device module (no hardware).

These prove which vendor API names a plugin calls and never calls. Hardware
behaviour of ROCm, XPU, NPU and MUSA is NOT verified here (see the README matrix).
"""

import types

import pytest
import torch

from torchhal.platforms import IpcHandle, IpcHandleError, TorchhalPluginWarning
from torchhal.plugins.cuda import CudaPlatform
from torchhal.plugins.musa import MusaPlatform
from torchhal.plugins.npu import NpuPlatform
from torchhal.plugins.rocm import RocmPlatform
from torchhal.plugins.xpu import XpuPlatform

from .fakes import MiB, install_broken_extension, install_extension, make_device_module, names_called

VENDORS = {
    # plugin class, extension module, device attr, graph class, dist backend, visible env
    "npu": (NpuPlatform, "torch_npu", "npu", "NPUGraph", "hccl", ("ASCEND_RT_VISIBLE_DEVICES",)),
    "musa": (MusaPlatform, "torch_musa", "musa", "MUSAGraph", "mccl", ("MUSA_VISIBLE_DEVICES",)),
    "xpu": (XpuPlatform, None, "xpu", "XPUGraph", "xccl", ("ZE_AFFINITY_MASK",)),
}


@pytest.fixture(params=sorted(VENDORS))
def vendor(request, monkeypatch):
    cls, ext, attr, graph_class, backend, env = VENDORS[request.param]
    module = make_device_module(attr, graph_class=graph_class)
    if ext:
        install_extension(monkeypatch, ext, attr, module)
    else:
        monkeypatch.setattr(torch, attr, module, raising=False)
        monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)  # an XPU build
    return types.SimpleNamespace(plugin=cls(), module=module, graph_class=graph_class, backend=backend, env=env)


def test_facts(vendor):
    assert vendor.plugin.dist_backend == vendor.backend
    assert vendor.plugin.visible_devices_env == vendor.env
    assert vendor.plugin.is_available()
    info = vendor.plugin.device_info(1)
    assert info.name.endswith(" 1") and info.total_memory == 1000 * MiB
    # torch.xpu's device properties have no major/minor: no capability rather than a made-up one.
    assert info.capability == (None if vendor.plugin.device_type == "xpu" else (9, 0))


def test_memory_info_observes_only(vendor):
    mem = vendor.plugin.memory_info(1)
    assert (mem.free, mem.total, mem.reserved, mem.allocated) == (936 * MiB, 1000 * MiB, 64 * MiB, 16 * MiB)
    called = names_called(vendor.module)
    assert "empty_cache" not in called and "synchronize" not in called
    assert {c[1] for c in vendor.module.calls if c[0] in ("mem_get_info", "memory_reserved")} == {1}


def test_empty_cache_reports_bytes_released(vendor):
    assert vendor.plugin.empty_cache(0) == 48 * MiB
    assert vendor.plugin.memory_info(0).reserved == 16 * MiB


def test_oom_type_is_the_vendor_one(vendor):
    # torch.npu and torch.xpu define no OutOfMemoryError: torch's own is theirs.
    expected = getattr(vendor.module, "OutOfMemoryError", torch.OutOfMemoryError)
    assert expected in vendor.plugin.oom_error_types()
    assert torch.OutOfMemoryError in vendor.plugin.oom_error_types()


def test_graph_capture_uses_vendor_names_and_never_empties(vendor):
    support = vendor.plugin.graph_support()
    assert support.graph_class.__name__ == vendor.graph_class
    pool = support.new_pool()
    graph = support.graph_class()
    with support.capture(graph, pool, "side-stream"):
        vendor.module.calls.append(("work",))
    called = vendor.module.calls
    assert ("stream:enter", "side-stream") in called
    begin = called.index(("capture_begin", pool))
    assert called[begin + 1] == ("work",) and called[begin + 2] == ("capture_end",)
    assert "empty_cache" not in names_called(vendor.module)
    assert "synchronize" not in names_called(vendor.module)


def test_capture_keeps_the_collector_off_until_it_ends_without_collecting(vendor, monkeypatch):
    import gc

    support = vendor.plugin.graph_support()
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(args) or 0)
    assert gc.isenabled()
    with support.capture(support.graph_class(), support.new_pool(), "side-stream"):
        assert not gc.isenabled()
    assert gc.isenabled()
    assert collected == []  # a full collection per graph is slow in a large process (seconds per engine)
    with pytest.raises(RuntimeError, match="inside"), support.capture(support.graph_class(), None, "s"):
        raise RuntimeError("inside")
    assert gc.isenabled() and vendor.module.calls[-1] == ("capture_end",)


def test_graphs_declared_unsupported_where_the_build_lacks_them(vendor):
    delattr(vendor.module, vendor.graph_class)
    assert vendor.plugin.graph_support() is None


def test_a_graph_class_without_the_rest_of_the_graph_api_is_unsupported_with_a_warning(vendor):
    delattr(vendor.module, "graph_pool_handle")  # an extension with the class but not the rest
    with pytest.warns(TorchhalPluginWarning, match=rf"declares graph_class_name='{vendor.graph_class}', which is "
                                                  r"there, but \S+\.graph_pool_handle is not: no graph support; "
                                                  "install a device extension that has them all, or declare "
                                                  "graph_class_name = None"):
        assert vendor.plugin.graph_support() is None


def test_xpu_estimates_free_memory_where_mem_get_info_raises(monkeypatch):
    module = make_device_module("xpu", mem_get_info_raises=True)
    monkeypatch.setattr(torch, "xpu", module, raising=False)
    mem = XpuPlatform().memory_info(0)
    assert mem.estimated and mem.free == 1000 * MiB - 64 * MiB and mem.reserved == 64 * MiB


def test_xpu_declares_no_ipc(monkeypatch):
    monkeypatch.setattr(torch, "xpu", make_device_module("xpu"), raising=False)
    assert XpuPlatform().ipc_support() is None


@pytest.mark.parametrize("cls, ext", [(NpuPlatform, "torch_npu"), (MusaPlatform, "torch_musa")])
def test_detection_with_runtime_absent(cls, ext, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, ext, None)  # import fails with ImportError
    result = cls().is_available()
    assert not result and ext in result.reason


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Two accelerators cannot be used at the same time"),
        OSError("libascendcl.so: cannot open shared object file"),
    ],
)
def test_npu_detection_survives_a_broken_torch_npu(error, monkeypatch):
    install_broken_extension(monkeypatch, "torch_npu", error)
    result = NpuPlatform().is_available()
    assert not result and str(error) in result.reason


def test_xpu_on_a_torch_build_without_xpu_names_the_build_not_the_visible_devices_variable(monkeypatch):
    monkeypatch.setattr(torch.version, "xpu", None, raising=False)  # a CPU or CUDA build: torch.xpu is there
    monkeypatch.setattr(torch, "xpu", make_device_module("xpu", count=0), raising=False)
    result = XpuPlatform().is_available()
    assert not result and "ZE_AFFINITY_MASK" not in result.reason
    assert result.reason == f"this torch build ({torch.__version__}) has no XPU support: install torch's XPU build"


def test_detection_is_idempotent_and_touches_no_device(vendor):
    first, second = vendor.plugin.is_available(), vendor.plugin.is_available()
    assert first == second
    assert set(names_called(vendor.module)) <= {"device_count", "is_available"}


# -- CUDA / ROCm: one build, never both -------------------------------------------


@pytest.mark.parametrize(
    "cuda, hip, count, cuda_ok, rocm_ok",
    [
        ("12.4", None, 2, True, False),
        (None, "6.2", 2, False, True),
        ("12.4", None, 0, False, False),  # CUDA build on a machine with no GPU
        (None, None, 0, False, False),  # CPU build
    ],
)
def test_cuda_and_rocm_never_both_claim(cuda, hip, count, cuda_ok, rocm_ok, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    assert bool(CudaPlatform().is_available()) is cuda_ok
    assert bool(RocmPlatform().is_available()) is rocm_ok
    assert RocmPlatform.visible_devices_env[:2] == ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
    assert RocmPlatform.dist_backend == CudaPlatform.dist_backend == "nccl"


def test_cuda_detection_reports_a_failing_driver(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.version, "hip", None, raising=False)

    def broken():
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(torch.cuda, "device_count", broken)
    result = CudaPlatform().is_available()
    assert not result and "driver initialization failed" in result.reason


# -- IPC mapping ------------------------------------------------------------------------


# The ref-counter handle names a real torch shared-memory file: the open checks it exists
# (a regular file of this user) before any native call would map it.
_REF_COUNTER = torch.zeros(128, dtype=torch.int64)
RC_NAME = bytes(_REF_COUNTER.untyped_storage()._share_filename_cpu_()[1])


class FakeStorage:
    def __init__(self, method, device):
        self.method, self.device = method, device

    def __getattr__(self, name):
        if name != self.method:
            raise AttributeError(name)
        return lambda: (self.device, b"\x01" * 64, 4096, 256, RC_NAME, 8, b"\x02" * 64, True)


def fake_device_tensor(device_type, method, device=1):
    return types.SimpleNamespace(
        device=types.SimpleNamespace(type=device_type),
        untyped_storage=lambda: FakeStorage(method, device),
        dtype=torch.float32,
        shape=(4, 8),
        stride=lambda: (8, 1),
        storage_offset=lambda: 16,
        element_size=lambda: 4,
    )


@pytest.mark.parametrize(
    "name, share, open_, peer, expect_device",
    [
        ("musa", "_share_musa_", "_new_shared_musa", True, 0),  # redirected to the consumer
        ("musa", "_share_musa_", "_new_shared_musa", False, 1),  # no peer access: producer's
        ("npu", "_share_npu_", "_new_shared_npu", True, 1),  # NPU never redirects
    ],
)
def test_ipc_share_and_open_mapping(name, share, open_, peer, expect_device, monkeypatch):
    cls, ext, attr, graph_class, *_ = VENDORS[name]
    module = make_device_module(attr, graph_class=graph_class, peer_access=peer)
    install_extension(monkeypatch, ext, attr, module)
    opened = []

    def fake_open(device, *fields):
        opened.append((device, fields))
        return torch.UntypedStorage(4096)

    monkeypatch.setattr(torch.UntypedStorage, open_, staticmethod(fake_open), raising=False)
    plugin = cls()
    support = plugin.ipc_support()
    handle = support.share(fake_device_tensor(attr, share))
    assert isinstance(handle, IpcHandle) and handle.device == 1 and handle.storage_nbytes == 4096
    assert handle.offset_bytes == 64 and handle.shape == (4, 8)
    tensor = support.open(handle, 0)
    assert opened[0][0] == expect_device
    assert opened[0][1] == (b"\x01" * 64, 4096, 256, RC_NAME, 8, b"\x02" * 64, True)
    assert ("device:enter", expect_device) in module.calls
    assert tensor.shape == (4, 8) and tensor.storage_offset() == 16


def test_ipc_open_rejects_out_of_bounds_before_opening(monkeypatch):
    module = make_device_module("musa", graph_class="MUSAGraph")
    install_extension(monkeypatch, "torch_musa", "musa", module)
    opened = []
    record = staticmethod(lambda *a: opened.append(a))
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_musa", record, raising=False)
    plugin = MusaPlatform()
    handle = plugin.ipc_share(fake_device_tensor("musa", "_share_musa_"))
    import dataclasses

    for bad, message in [
        (dataclasses.replace(handle, offset_bytes=4096), "reaches byte"),
        (dataclasses.replace(handle, dtype="object"), "unknown dtype"),
        (dataclasses.replace(handle, device=5, storage=(5, *handle.storage[1:])), "not a visible musa device"),
        (dataclasses.replace(handle, storage=handle.storage[:3]), "malformed"),
        (dataclasses.replace(handle, platform="cuda"), "from platform 'cuda'"),
    ]:
        with pytest.raises(IpcHandleError, match=message):
            plugin.ipc_open(bad, 0)
    assert opened == []  # nothing was mapped for a bad handle


# -- declarations: the shared detection, peaks, peers, the IPC redirect switch -------------


def test_no_visible_device_names_the_visible_devices_variable(monkeypatch):
    install_extension(monkeypatch, "torch_musa", "musa", make_device_module("musa", count=0))
    monkeypatch.setenv("MUSA_VISIBLE_DEVICES", "")
    result = MusaPlatform().is_available()
    assert not result and "no device is visible" in result.reason and "MUSA_VISIBLE_DEVICES=''" in result.reason
    monkeypatch.delenv("MUSA_VISIBLE_DEVICES")
    assert "check MUSA_VISIBLE_DEVICES" in MusaPlatform().is_available().reason


def test_vendor_plugins_declare_and_do_not_redefine_detection():
    for cls in (NpuPlatform, MusaPlatform):
        assert "is_available" not in vars(cls) and "runtime_version" not in vars(cls)
    assert "is_available" not in vars(CudaPlatform) and "is_available" not in vars(RocmPlatform)


def test_runtime_version_names_the_extension(vendor):
    version = vendor.plugin.runtime_version()
    assert version and ("9.9-fake" in version or "torch.xpu" in version)


def test_argument_free_queries_are_the_module_functions_once_resolved(vendor):
    vendor.plugin.device_module()
    assert vendor.plugin.device_count is vendor.module.device_count
    assert vendor.plugin.current_device is vendor.module.current_device

    class Counting(type(vendor.plugin)):
        def device_count(self):  # an override is never shadowed by the binding
            return 7

    plugin = Counting()
    plugin.device_module()
    assert plugin.device_count() == 7


def test_peak_memory_reset_and_peer_access_map_to_vendor_names(vendor):
    peak = vendor.plugin.peak_memory(1)
    assert (peak.device, peak.reserved, peak.allocated) == (1, 128 * MiB, 32 * MiB)
    vendor.plugin.reset_peak_memory(1)
    assert ("reset_peak_memory_stats", 1) in vendor.module.calls
    assert vendor.plugin.can_access_peer(0, 1) is True
    assert ("can_device_access_peer", 0, 1) in vendor.module.calls
    assert "empty_cache" not in names_called(vendor.module)


def test_the_ipc_redirect_switch_opens_on_the_producer_device(monkeypatch):
    from torchhal.platforms import Platform, manager

    module = make_device_module("musa", graph_class="MUSAGraph", peer_access=True)
    install_extension(monkeypatch, "torch_musa", "musa", module)
    opened = []
    monkeypatch.setattr(
        torch.UntypedStorage, "_new_shared_musa",
        staticmethod(lambda device, *fields: opened.append(device) or torch.UntypedStorage(4096)), raising=False,
    )
    platform = Platform(MusaPlatform(), manager.PluginManager(), "test", "0")
    handle = platform.ipc_support.share(fake_device_tensor("musa", "_share_musa_"))
    assert platform.ipc_support.peer_redirect
    platform.ipc_support.open(handle, 0)
    platform.set_ipc_peer_redirect(False)
    assert not platform.ipc_support.peer_redirect  # the record is asked again
    platform.ipc_support.open(handle, 0)
    assert opened == [0, 1]  # redirected to the consumer, then on the producer's device
    assert MusaPlatform().ipc_peer_redirect is True  # other instances keep the declaration
    platform.set_ipc_peer_redirect(True)
    assert platform.ipc_support.peer_redirect


def test_cuda_current_stream_is_one_object_per_runtime_stream(monkeypatch):
    """Mapping (no GPU): the stream object is cached by the runtime's stream key, never reused
    for another stream, and the runtime is initialized through torch before the first lookup."""
    runtime = {"initialized": False, "key": (0, 1, 1)}
    made: list[dict] = []

    def make_stream(**key):
        made.append(key)
        return types.SimpleNamespace(**key)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: runtime["initialized"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: ("initializing", index))
    monkeypatch.setattr(torch.cuda, "Stream", make_stream)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: (*runtime["key"][:1], index, 1),
                        raising=False)
    plugin = CudaPlatform()
    assert plugin.current_stream(1) == ("initializing", 1)  # torch's own path until initialized
    runtime["initialized"] = True
    first = plugin.current_stream(1)
    assert plugin.current_stream(1) is first and len(made) == 1
    assert (first.stream_id, first.device_index, first.device_type) == (0, 1, 1)
    runtime["key"] = (7, 1, 1)  # `with torch.cuda.stream(s)`: another current stream
    other = plugin.current_stream(1)
    assert other is not first and other.stream_id == 7
    assert plugin.current_stream(0) is not first and made[-1] == {"stream_id": 7, "device_index": 0, "device_type": 1}
    runtime["key"] = (0, 1, 1)
    assert plugin.current_stream(1) is first and len(made) == 3


# -- distributed: device per rank, backend declarations ---------------------------------

DISTRIBUTED = {
    # plugin class, its first visible-devices variable, collectives graph-capturable
    "cuda": (CudaPlatform, "CUDA_VISIBLE_DEVICES", True),
    "rocm": (RocmPlatform, "HIP_VISIBLE_DEVICES", False),
    "xpu": (XpuPlatform, "ZE_AFFINITY_MASK", False),
    "npu": (NpuPlatform, "ASCEND_RT_VISIBLE_DEVICES", False),
    "musa": (MusaPlatform, "MUSA_VISIBLE_DEVICES", False),
}


def with_devices(cls, count, monkeypatch):
    """The plugin seeing `count` devices (a fake device module: a mapping test, no hardware)."""
    plugin = cls()
    monkeypatch.setattr(plugin, "device_module", lambda: types.SimpleNamespace(device_count=lambda: count))
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "ZE_AFFINITY_MASK",
                "ASCEND_RT_VISIBLE_DEVICES", "MUSA_VISIBLE_DEVICES"):
        monkeypatch.delenv(var, raising=False)
    return plugin


@pytest.mark.parametrize("name", sorted(DISTRIBUTED))
def test_device_for_rank_counts_the_devices_the_variable_left_visible(name, monkeypatch):
    cls, var, _ = DISTRIBUTED[name]
    plugin = with_devices(cls, 2, monkeypatch)
    monkeypatch.setenv(var, "3,5")
    # The runtime renumbered 3,5 as 0,1: local rank 1 uses index 1 (physical device 5).
    assert [plugin.device_for_rank(r, 2) for r in range(2)] == [0, 1]
    with pytest.raises(ValueError, match=rf"4 local ranks need 4 {name} devices, but 2 are visible "
                                         rf"\({var}='3,5'\)"):
        plugin.device_for_rank(3, 4)


@pytest.mark.parametrize("name", sorted(DISTRIBUTED))
def test_device_for_rank_with_one_device_visible_per_rank_is_index_0(name, monkeypatch):
    cls, var, _ = DISTRIBUTED[name]
    plugin = with_devices(cls, 1, monkeypatch)
    monkeypatch.setenv(var, "5")  # a launcher pinned this rank to its own device
    assert plugin.device_for_rank(1, 2) == 0
    monkeypatch.delenv(var)  # no variable: one device for two ranks is a mistake, not a pinning
    with pytest.raises(ValueError, match="2 local ranks need 2 .* but 1 is visible: start at most 1"):
        plugin.device_for_rank(1, 2)


@pytest.mark.parametrize("name", sorted(DISTRIBUTED))
def test_distributed_support_declares_capture_only_where_the_backend_allows_it(name):
    cls, _, capturable = DISTRIBUTED[name]
    support = cls().distributed_support()
    assert support.graph_capturable is capturable
    if name == "cuda":  # NCCL, with small sums through peer memory (tests/test_peer_memory.py)
        from torchhal.plugins.cuda_collectives import peer_memory_communicator

        assert support.communicator is peer_memory_communicator
    else:
        assert support.communicator is None  # torch's backend, called on torchhal's own groups
    assert support.note


def test_cpu_ranks_all_use_the_one_host_device():
    from torchhal.plugins.cpu import CpuPlatform

    assert [CpuPlatform().device_for_rank(r, 4) for r in range(4)] == [0, 0, 0, 0]
    assert CpuPlatform().distributed_support().graph_capturable is False
