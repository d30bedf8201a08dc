"""Errors raised by the platform layer. Each message says what, with what value, and what to do."""


class PlatformError(RuntimeError):
    """Base class for torchhal platform errors."""


class UnknownPlatformError(PlatformError, LookupError):
    """A platform name that no registered plugin provides."""


class PlatformUnavailableError(PlatformError):
    """A known platform that cannot run on this machine."""


class AmbiguousPlatformError(PlatformError):
    """Kept for compatibility: no longer raised, a priority tie now resolves by a fixed rule."""


class PluginConflictError(PlatformError):
    """Two distributions registered the same platform name."""


class PluginContractError(PlatformError, TypeError):
    """A plugin returned a value of the wrong type from an SPI call."""


class IpcHandleError(PlatformError, ValueError):
    """An IPC handle that does not describe a valid view of its storage."""


class TorchhalPluginWarning(UserWarning):
    """A plugin failed to import, register, validate or detect, or an observer raised."""
