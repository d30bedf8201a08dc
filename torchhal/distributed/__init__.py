"""Ranks on several devices, the same way on every platform.

`init_group` makes a `DeviceGroup`: the rank's device (`Platform.device_for_rank`) and a
`Communicator` (all-reduce, all-gather, broadcast, send/recv) on the platform's backend,
or the vendor's own communicator where its plugin supplies one (`DistributedSupport`).
`launch` runs a function on N ranks of this host; across hosts, start the ranks with torchrun.
"""

from torchhal.distributed.group import DEFAULT_TIMEOUT, DeviceGroup, RankPlacement, init_group
from torchhal.distributed.launch import LaunchError, launch
from torchhal.platforms.communicator import (
    REDUCE_OPS,
    CollectiveError,
    Communicator,
    ReduceOpName,
    TorchCommunicator,
    WrappedCommunicator,
)

__all__ = [
    "CollectiveError",
    "DEFAULT_TIMEOUT",
    "REDUCE_OPS",
    "Communicator",
    "DeviceGroup",
    "LaunchError",
    "RankPlacement",
    "ReduceOpName",
    "TorchCommunicator",
    "WrappedCommunicator",
    "init_group",
    "launch",
]
