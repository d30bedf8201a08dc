"""Sleep and wake: the weights and KV pool leave the device and come back.

While asleep the model's parameters *are* the pinned host copies, so a weight update
made while asleep lands in what wake brings back: the newest weights always win.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchhal.core.engine.runners import ModelRunner
from torchhal.core.model import KVCache, Model
from torchhal.platforms import Platform

HOST = torch.device("cpu")


class MemoryOccupation:
    def __init__(self, platform: Platform, device: torch.device) -> None:
        self.platform, self.device = platform, device
        self.asleep = False

    def sleep(self, model: Model, runner: ModelRunner) -> None:
        runner.release()
        with torch.no_grad():
            # Each parameter moves into pinned host memory in place (tied parameters are
            # one object, so they stay tied); buffers follow with the module move below.
            for _, param in model.named_parameters():
                param.data = self.platform.pin_memory(param.data.to(HOST))
        model.to(HOST)
        model.kv = None
        self.asleep = True

    def wake(self, model: Model, runner: ModelRunner, make_kv: Callable[[], KVCache]) -> None:
        model.to(self.device)
        model.process_weights()
        model.kv = make_kv()
        self.asleep = False
        runner.resume()
