"""Sleep and wake: the weights and KV pool leave the device and come back.

While asleep the model's parameters *are* the pinned host copies, so a weight update
made while asleep lands in what wake brings back: the newest weights always win.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchhal.core.devices import model_placement
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
        pin = self.platform.pin_memory

        def to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
            return pin(tensor.to(HOST))

        with torch.no_grad():
            # The module's own move (what `.to()` runs), pinning each tensor as it lands:
            # parameters move in place (tied ones are one object, so they stay tied) and a
            # model's `_apply` override sees the move. Pinning parameters one by one would
            # miss storage they merely view (the decoder's fused QKV / gate-up weights).
            model._apply(to_pinned_host)
        model.kv = None
        self.asleep = True

    def wake(self, model: Model, runner: ModelRunner, make_kv: Callable[[], KVCache]) -> None:
        model.to(model_placement(model, self.device))
        model.process_weights()
        model.kv = make_kv()
        self.asleep = False
        runner.resume()
