"""Moore Threads MUSA: torch.musa after importing torch_musa.

torch_musa mirrors torch.cuda name for name, including IPC (`_share_musa_` /
`_new_shared_musa`, the CUDA path with the device index redirected).

Attention: torch_musa (2.7.1) has no public paged-attention entry point (its flash
attention serves torch's dense SDPA and takes no block table), so MUSA declares no
backend and engines run torchhal's portable reference on the device.
"""

from __future__ import annotations

from torchhal.platforms import DistributedSupport, PlatformPlugin, hookimpl
from torchhal.plugins.accelerator import AcceleratorPlatform
from torchhal.plugins.vendor_attention import ReferenceAttentionOnly


class MusaPlatform(ReferenceAttentionOnly, AcceleratorPlatform):
    name = "musa"
    device_type = "musa"
    priority = 90
    dist_backend = "mccl"
    visible_devices_env = ("MUSA_VISIBLE_DEVICES",)
    extension_module = "torch_musa"
    graph_class_name = "MUSAGraph"
    ipc_share_method = "_share_musa_"
    ipc_open_method = "_new_shared_musa"
    ipc_peer_redirect = True
    reference_attention_because = (
        "torch_musa has no public paged-attention entry point (its flash attention takes no block table)"
    )


    def distributed_support(self) -> DistributedSupport:
        # torch.distributed's all_reduce calls MUSA APIs that a MUSA graph capture refuses;
        # engines that capture MCCL call the library directly instead.
        return DistributedSupport(note="MCCL, registered by torch_musa; collectives not graph-captured")


@hookimpl
def torchhal_register_platforms() -> list[PlatformPlugin]:
    return [MusaPlatform()]
