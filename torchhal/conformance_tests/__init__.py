"""The torchhal conformance suite: run by vendors, on their own hardware.

    torchhal conformance [--platform NAME] [--profile core|full] ...
    pytest --pyargs torchhal.conformance_tests --torchhal-platform NAME

Each test belongs to one capability group; see docs/conformance.md.
"""

SUITE_VERSION = "1.0.0"
GROUPS = ("contract", "device", "memory", "graphs", "ipc", "distributed")
PROFILES = {
    "core": ("contract", "device", "memory"),
    "full": GROUPS,
}
#: Skip reasons that mean "not required here" rather than "could not be checked".
NOT_REQUIRED_PREFIXES = ("undeclared:", "not applicable:")
