"""The device-index check engine code shares (the engine's config, the residency manager)."""

from __future__ import annotations

from torchhal.platforms import Platform


def check_device_index(platform: Platform, index: object, label: str) -> int:
    """`index` if the platform has that device (None: its current device), else a ValueError
    naming `label`, the value and the range. A platform that reports no devices (a host-only
    one) still has device 0."""
    if index is None:
        return platform.current_device()
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"{label} = {index!r} must be a device index (an int >= 0, e.g. 0) "
                         "or None for the current device")
    count = platform.device_count()
    if index >= max(count, 1):
        raise ValueError(
            f"{label} = {index!r}, but platform {platform.name!r} has {count} device(s); "
            f"pass 0..{max(count - 1, 0)}, or None for the current device"
        )
    return index
