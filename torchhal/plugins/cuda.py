"""NVIDIA CUDA: torch.cuda on a CUDA build of torch with a visible GPU."""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar

import torch

from torchhal.platforms import (
    AttentionSupport,
    CompileSupport,
    DistributedSupport,
    IpcEvents,
    IpcHandleError,
    LinearSupport,
    MemoryInfo,
    PlatformPlugin,
    VirtualMemorySupport,
    hookimpl,
)
from torchhal.plugins.accelerator import AcceleratorPlatform
from torchhal.plugins.cuda_collectives import PEER_MEMORY_BYTES, peer_memory_communicator


class CudaPlatform(AcceleratorPlatform):
    name = "cuda"
    device_type = "cuda"
    priority = 100
    dist_backend = "nccl"
    visible_devices_env: ClassVar[tuple[str, ...]] = ("CUDA_VISIBLE_DEVICES",)
    graph_class_name = "CUDAGraph"
    ipc_share_method = "_share_cuda_"
    ipc_open_method = "_new_shared_cuda"
    ipc_peer_redirect = True

    def __init__(self) -> None:
        super().__init__()
        self._streams: dict[tuple[int, int, int], Any] = {}  # see current_stream

    def distributed_support(self) -> DistributedSupport:
        # ProcessGroupNCCL checks the stream's capture status and keeps captured work off
        # its watchdog, so NCCL collectives record into a CUDA graph and replay; so does the
        # peer-memory kernel.
        return DistributedSupport(
            communicator=peer_memory_communicator, graph_capturable=True,
            note=f"NCCL (torch ProcessGroupNCCL), CUDA-graph capturable; sum all-reduces of <= "
                 f"{PEER_MEMORY_BYTES // 1024} KiB through peer memory where every rank shares a host "
                 "(torch symmetric memory, one-shot)",
        )

    def current_stream(self, index: int) -> Any:
        # torch.cuda.current_stream builds a Stream object on every call (a device guard
        # inside: ~3 us on an H200 host), and hot paths look the stream up per call (the
        # transport, per message). The runtime's (stream id, device, type) key costs ~0.2 us:
        # one Stream object per key, which names the same stream as a new one would.
        module = self.device_module()
        if not module.is_initialized():
            return module.current_stream(index)  # initializes the runtime as torch does
        key = torch._C._cuda_getCurrentStream(index)
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= MAX_KNOWN_STREAMS:
                self._streams.clear()
            stream = self._streams[key] = module.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
        return stream

    def runtime_missing(self) -> str | None:
        if getattr(torch.version, "hip", None):
            return f"this torch is a ROCm build (HIP {torch.version.hip}); use the rocm platform"
        if not torch.version.cuda:
            return f"this torch build ({torch.__version__}) has no CUDA support"
        return None

    def memory_info(self, index: int) -> MemoryInfo:
        # The floor: one mem_get_info and one read of the allocator's stats dict.
        # memory_reserved() would flatten the whole dict (~140 us on an H100).
        # mem_get_info initialises CUDA first, so the stats read needs no guard.
        free, total = torch.cuda.mem_get_info(index)
        stats = torch._C._cuda_memoryStats(index)
        return MemoryInfo(
            index, free, total, stats["reserved_bytes"]["all"]["current"], stats["allocated_bytes"]["all"]["current"]
        )

    def allocator_bytes(self, index: int) -> tuple[int, int]:
        # As in memory_info: the two counters from the nested dict, not memory_reserved().
        if not torch.cuda.is_initialized():
            return 0, 0
        stats = torch._C._cuda_memoryStats(index)
        return int(stats["reserved_bytes"]["all"]["current"]), int(stats["allocated_bytes"]["all"]["current"])

    # -- interprocess events: torch.cuda.Event(interprocess=True), ipc_handle, from_ipc_handle --
    def ipc_events(self) -> IpcEvents | None:
        if not hasattr(self.device_module().Event, "from_ipc_handle"):
            return None
        return IpcEvents(
            new=self.ipc_event_new, export=self.ipc_event_export, open=self.ipc_event_open,
            handle_nbytes=IPC_EVENT_HANDLE_NBYTES,
        )

    def ipc_event_new(self, index: int) -> Any:
        module = self.device_module()
        with module.device(index):
            return module.Event(interprocess=True)  # interprocess events never time

    def ipc_event_export(self, event: Any) -> bytes:
        return _checked_event_handle(self.name, event.ipc_handle())

    def ipc_event_open(self, handle: bytes, producer: int, consumer: int) -> Any:
        _checked_event_handle(self.name, handle)
        count = self.device_count()
        for label, index in (("producer", producer), ("consumer", consumer)):
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
                raise IpcHandleError(
                    f"IPC event {label} device {index!r} is not a visible {self.name} device (0..{count - 1})"
                )
        # Opened where the memory open maps (the consumer's device where peers allow), so the
        # consumer makes no context on the producer's device.
        target = self.ipc_target_device(producer, consumer)
        module = self.device_module()
        try:
            with module.device(target):
                return module.Event.from_ipc_handle(target, handle)
        except Exception as exc:  # the driver refused the handle
            raise IpcHandleError(f"{self.name} IPC event open failed: {type(exc).__name__}: {exc}") from exc

    def attention_support(self) -> AttentionSupport | None:
        # Triton is optional: without it the platform falls back on the reference backend.
        if importlib.util.find_spec("triton") is None:
            return None
        from torchhal.plugins import cuda_flash
        from torchhal.plugins.cuda_attention import TritonPagedAttention

        return AttentionSupport(backends=(TritonPagedAttention(),),
                                note=f"Triton kernels (torchhal); {cuda_flash.describe()}")

    def linear_support(self) -> LinearSupport | None:
        # The Triton GEMV for one-row linears (decode); without Triton, F.linear everywhere.
        if importlib.util.find_spec("triton") is None:
            return None
        from torchhal.plugins.cuda_linear import triton_gemv

        return triton_gemv()

    def compile_support(self) -> CompileSupport | None:
        # Programmatic dependent launch for inductor's kernels, as the plugin's own Triton
        # kernels use it (cuda_pdl): Hopper and later, unless TORCHHAL_CUDA_PDL=0.
        if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
            return None
        from torchhal.plugins.cuda_pdl import programmatic_launch

        if not programmatic_launch(torch.cuda.current_device()):
            return None
        return CompileSupport(
            inductor_options={"triton.enable_pdl": True},
            note="programmatic dependent launch: a kernel launches while the one before it finishes",
        )

    def virtual_memory_support(self) -> VirtualMemorySupport | None:
        if not torch.cuda.is_available():
            return None
        from torchhal.plugins.virtual_memory import Regions, VmmDriver, cuda_pools, registered_host_buffer

        def new_regions(index: int) -> Regions:
            driver = VmmDriver("libcuda.so.1", "cu", torch.device("cuda", index), lambda: torch.cuda.synchronize(index))
            return Regions(driver, registered_host_buffer, cuda_pools())

        return VirtualMemorySupport(
            new_regions, graph_memory=True,
            not_released=("the CUDA context", "NCCL communicators' buffers (a graph that captured a collective needs "
                          "NCCL_GRAPH_REGISTER=0 to replay after a release)"),
            note="CUDA virtual memory: cuMemCreate / cuMemMap under addresses kept by cuMemAddressReserve")

    def runtime_version(self) -> str | None:
        text = f"CUDA runtime {torch.version.cuda}"
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            text += f", driver {driver.decode() if isinstance(driver, bytes) else driver}"
        except Exception:  # nvidia-ml-py is optional (the `cuda` extra)
            pass
        return text


#: Stream objects `current_stream` keeps; more (streams made and dropped without end) start over.
MAX_KNOWN_STREAMS = 256
#: cudaIpcEventHandle_t (hipIpcEventHandle_t, behind torch.cuda on ROCm, is 64 bytes too).
IPC_EVENT_HANDLE_NBYTES = 64


def _checked_event_handle(platform: str, handle: object) -> bytes:
    if not isinstance(handle, bytes) or len(handle) != IPC_EVENT_HANDLE_NBYTES:
        raise IpcHandleError(f"{platform} IPC event handle {handle!r:.80} is not {IPC_EVENT_HANDLE_NBYTES} bytes")
    return handle


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [CudaPlatform()]
