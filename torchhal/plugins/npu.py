"""Huawei Ascend NPU: torch.npu after importing torch_npu (needs the CANN toolkit).

Known traps, all caught by the shared probe: torch_npu without CANN fails on
import (RuntimeError/OSError), and torch_npu refuses non-CPU torch builds ("Two
accelerators cannot be used at the same time"). IPC opens stay on the
producer's device (`ipc_peer_redirect` is left False): the redirect is not
verified on Ascend.
"""

from __future__ import annotations

from torchhal.platforms import PlatformPlugin, hookimpl
from torchhal.plugins.accelerator import AcceleratorPlatform


class NpuPlatform(AcceleratorPlatform):
    name = "npu"
    device_type = "npu"
    priority = 90
    dist_backend = "hccl"
    visible_devices_env = ("ASCEND_RT_VISIBLE_DEVICES",)
    extension_module = "torch_npu"
    runtime_hint = "needs torch_npu and the CANN toolkit: pip install 'torchhal[npu]'"
    graph_class_name = "NPUGraph"
    # torch_npu.multiprocessing.reductions shares storages with these methods.
    ipc_share_method = "_share_npu_"
    ipc_open_method = "_new_shared_npu"


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [NpuPlatform()]
