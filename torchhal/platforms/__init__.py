"""The hook system and the platform API: what vendors and engines touch."""

from torchhal.platforms.errors import (
    AmbiguousPlatformError,
    IpcHandleError,
    PlatformError,
    PlatformUnavailableError,
    PluginConflictError,
    UnknownPlatformError,
)
from torchhal.platforms.hookspecs import hookimpl, hookspec
from torchhal.platforms.manager import DEFAULT_PLUGINS, ENTRY_POINT_GROUP, TorchhalPluginWarning
from torchhal.platforms.platform import Platform
from torchhal.platforms.plugin import SPI_ATTRIBUTES, SPI_METHODS, PlatformPlugin
from torchhal.platforms.records import (
    Availability,
    DeviceInfo,
    GraphSupport,
    IpcHandle,
    IpcSupport,
    MemoryInfo,
    PluginError,
    ReleasePoint,
)
from torchhal.platforms.selection import (
    PLATFORM_ENV,
    PlatformStatus,
    current_platform,
    get_platform,
    how_resolved,
    list_platforms,
    registry,
    use_registry,
)

__all__ = [
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "PLATFORM_ENV",
    "SPI_ATTRIBUTES",
    "SPI_METHODS",
    "AmbiguousPlatformError",
    "Availability",
    "DeviceInfo",
    "GraphSupport",
    "IpcHandle",
    "IpcHandleError",
    "IpcSupport",
    "MemoryInfo",
    "Platform",
    "PlatformError",
    "PlatformPlugin",
    "PlatformStatus",
    "PlatformUnavailableError",
    "PluginConflictError",
    "PluginError",
    "ReleasePoint",
    "TorchhalPluginWarning",
    "UnknownPlatformError",
    "current_platform",
    "get_platform",
    "hookimpl",
    "hookspec",
    "how_resolved",
    "list_platforms",
    "registry",
    "use_registry",
]
