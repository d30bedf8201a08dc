"""Device checks engine code shares: the device index (the engine's config, the residency
manager), where a model moves, and whether an error already raised was out of memory."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from torchhal.platforms import Platform, TorchhalPluginWarning
from torchhal.values import as_index


def check_device_index(platform: Platform, index: object, label: str) -> int:
    """`index` as a plain int if the platform has that device (None: its current device), else
    a ValueError naming `label`, the value and the range. Any integer but a bool (numpy's too).
    A platform that reports no devices (a host-only one) still has device 0."""
    if index is None:
        return platform.current_device()
    number = as_index(index)
    if number is None or number < 0:
        raise ValueError(f"{label} = {index!r} must be a device index (an int >= 0, e.g. 0) "
                         "or None for the current device")
    count = platform.device_count()
    if number >= max(count, 1):
        raise ValueError(
            f"{label} = {number}, but platform {platform.name!r} has {count} device(s); "
            f"pass 0..{max(count - 1, 0)}, or None for the current device"
        )
    return number


def model_placement(model: Any, device: torch.device) -> torch.device:
    """Where to move `model` (anything with `named_parameters()`) to run on `device`: `device`,
    except that a model already in host memory stays where it is for a host device (torch
    copies every tensor from `cpu` to `cpu:0`, which is the same memory)."""
    if device.type == "cpu":
        first = next((tensor for _, tensor in model.named_parameters()), None)
        if first is not None and first.device.type == "cpu":
            return first.device
    return device


def is_out_of_memory(platform: Platform, error: BaseException) -> bool:
    """The platform's rule, asked on the path of an error already raised: a rule that itself
    fails (a plugin bug) is warned about and the error handled as not an OOM, so the caller's
    recovery (a rollback, an abandoned request) still runs and it is the caller's error that
    propagates, not the rule's."""
    try:
        return bool(platform.is_out_of_memory(error))
    except Exception as broken:
        warnings.warn(
            f"platform {platform.name!r}: is_out_of_memory raised {type(broken).__name__}: {broken}; "
            f"the {type(error).__name__} it was asked about is handled as not out of memory",
            TorchhalPluginWarning, stacklevel=3,
        )
        return False
