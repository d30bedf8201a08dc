"""The hook system and the platform API: what vendors and engines touch.

`__all__` is the public face: `torchhal/core` and the conformance suite import
only these names (and the IPC view helpers of `torchhal.platforms.ipc`); the
conformance suite also uses the testing seam `torchhal.platforms.testing`.
"""

from torchhal.platforms.errors import (
    IpcHandleError,
    PlatformError,
    PlatformUnavailableError,
    PluginConflictError,
    PluginContractError,
    TorchhalPluginWarning,
    UnknownPlatformError,
)
from torchhal.platforms.hookspecs import hookimpl, hookspec
from torchhal.platforms.manager import (
    DEFAULT_PLUGINS,
    DETECT_TIMEOUT_ENV,
    ENTRY_POINT_GROUP,
    PlatformRegistry,
    RegisteredPlatform,
)
from torchhal.platforms.platform import FACTS as PLATFORM_FACTS
from torchhal.platforms.platform import Platform, check_platform_argument
from torchhal.platforms.plugin import (
    SPI_ATTRIBUTES,
    SPI_METHODS,
    SPI_VERSION,
    PlatformPlugin,
)
from torchhal.platforms.records import (
    AttentionSupport,
    Availability,
    CompileSupport,
    DeviceInfo,
    DistributedSupport,
    GraphSupport,
    IpcEvents,
    IpcHandle,
    IpcSupport,
    LinearSupport,
    MemoryInfo,
    MemoryRegions,
    PeakMemory,
    PluginFailure,
    ReleasePoint,
    VirtualMemorySupport,
)
from torchhal.platforms.selection import (
    PLATFORM_ENV,
    TIE_RULE,
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
    "DETECT_TIMEOUT_ENV",
    "ENTRY_POINT_GROUP",
    "PLATFORM_ENV",
    "SPI_ATTRIBUTES",
    "SPI_METHODS",
    "SPI_VERSION",
    "TIE_RULE",
    "AttentionSupport",
    "CompileSupport",
    "Availability",
    "DeviceInfo",
    "DistributedSupport",
    "GraphSupport",
    "IpcEvents",
    "IpcHandle",
    "IpcHandleError",
    "IpcSupport",
    "LinearSupport",
    "MemoryInfo",
    "MemoryRegions",
    "PeakMemory",
    "Platform",
    "PLATFORM_FACTS",
    "check_platform_argument",
    "PlatformError",
    "PlatformPlugin",
    "PlatformRegistry",
    "PlatformStatus",
    "PlatformUnavailableError",
    "PluginConflictError",
    "PluginContractError",
    "PluginFailure",
    "RegisteredPlatform",
    "ReleasePoint",
    "TorchhalPluginWarning",
    "UnknownPlatformError",
    "VirtualMemorySupport",
    "current_platform",
    "get_platform",
    "hookimpl",
    "hookspec",
    "how_resolved",
    "list_platforms",
    "registry",
    "use_registry",
]
