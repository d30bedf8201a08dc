"""A third-party platform plugin, installed in tests through a real entry point.

TORCHHAL_TESTPLUGIN_MODE picks its behaviour: "ok" (available, priority 5),
"unavailable", "raise" (is_available raises), "import" (fails to import).
"""

import os

import torch

from torchhal.platforms import Availability, hookimpl
from torchhal.plugins.cpu import CpuPlatform

MODE = os.environ.get("TORCHHAL_TESTPLUGIN_MODE", "unavailable")
if MODE == "import":
    raise ImportError("testaccel runtime library libtestaccel.so not found")


class TestAccelPlatform(CpuPlatform):
    name = "testaccel"
    device_type = "cpu"
    priority = 5

    def is_available(self) -> Availability:
        if MODE == "raise":
            raise RuntimeError("testaccel driver crashed while probing")
        if MODE == "ok":
            return Availability.yes("1 testaccel device")
        return Availability.no("no testaccel device present")

    def runtime_version(self) -> str:
        return f"testaccel 0.3 on torch {torch.__version__}"


@hookimpl
def torchhal_register_platforms():
    return [TestAccelPlatform()]
