"""The torchhal conformance suite: run by vendors, on their own hardware.

    torchhal conformance [--platform NAME] [--profile core|full] ...
    pytest -p torchhal.conformance_tests.plugin --pyargs torchhal.conformance_tests --torchhal-platform NAME

Both need the `conformance` extra (`pip install 'torchhal[conformance]'`: pytest, PyYAML).

Each test belongs to one capability group; see docs/conformance.md.
"""

SUITE_VERSION = "1.0.0"
GROUPS = ("contract", "device", "memory", "graphs", "ipc", "distributed", "attention", "linear", "compile",
          "virtual_memory")
PROFILES = {
    "core": ("contract", "device", "memory"),
    "full": GROUPS,
}
#: Skip reasons that mean "not required here" rather than "could not be checked".
NOT_REQUIRED_PREFIXES = ("undeclared:", "not applicable:")
#: Exit code of `torchhal conformance` (and of pytest running the suite) per verdict class.
#: docs/conformance.md lists them; scripts branch on them.
EXIT_CODES = {
    "CONFORMANT": 0,
    "NOT CONFORMANT": 1,
    "USAGE ERROR": 2,  # a bad option, --expect file or report path: nothing ran
    "INCOMPLETE": 3,
    "PLUGIN FAILURES": 4,  # platform chosen automatically while an installed plugin failed
    "NO TESTS RAN": 5,
    "SUITE ERROR": 6,  # the run ended without a verdict (internal error, interrupted)
}
