"""Sleep and wake: the weights and KV pool leave the device and come back.

While asleep the model's parameters *are* the pinned host copies, so a weight update
made while asleep lands in what wake brings back: the newest weights always win.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from torchhal.core.devices import model_placement
from torchhal.core.model import KVCache, Model
from torchhal.platforms import Platform

HOST = torch.device("cpu")


class Releasable(Protocol):
    """What holds device state built on the weights and KV pool: the runners' graphs."""

    def release(self) -> None: ...

    def resume(self) -> None: ...


class MemoryOccupation:
    """Sleep and wake, each all or nothing: a failure part-way (pinned host memory or device
    memory running out, a graph capture failing) leaves the engine as it was before the call,
    so the call can be retried, never half moved with some graphs captured."""

    def __init__(self, platform: Platform, device: torch.device) -> None:
        self.platform, self.device = platform, device
        self.asleep = False

    def sleep(self, model: Model, runners: Sequence[Releasable]) -> None:
        for runner in runners:
            runner.release()
        try:
            self._to_pinned_host(model)
        except BaseException:
            try:  # back awake: what moved returns, the graphs are recaptured
                self._to_device(model)
                for runner in runners:
                    runner.resume()
            except BaseException:  # nor that: asleep, whence a wake moves everything back
                self.drop_device_state(model, runners)
                self.asleep = True
            raise
        model.kv = None
        self.asleep = True

    def wake(self, model: Model, runners: Sequence[Releasable], make_kv: Callable[[], KVCache]) -> None:
        try:
            self._to_device(model)
            model.kv = make_kv()
            for runner in runners:
                runner.resume()
        except BaseException:
            # Back to sleep, so the wake can be retried. Weights left on the device by a failed
            # move back are moved by that wake too.
            self.drop_device_state(model, runners)
            with contextlib.suppress(Exception):
                self._to_pinned_host(model)
            raise
        self.asleep = False

    def _to_pinned_host(self, model: Model) -> None:
        pin = self.platform.pin_memory

        def to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
            return pin(tensor.to(HOST))

        with torch.no_grad():
            # The module's own move (what `.to()` runs), pinning each tensor as it lands:
            # parameters move in place (tied ones are one object, so they stay tied) and a
            # model's `_apply` override sees the move. Pinning parameters one by one would
            # miss storage they merely view (the decoder's fused QKV / gate-up weights).
            model._apply(to_pinned_host)

    def _to_device(self, model: Model) -> None:
        model.to(model_placement(model, self.device))
        model.process_weights()

    @staticmethod
    def drop_device_state(model: Model, runners: Sequence[Releasable]) -> None:
        """The runners' graphs and the KV cache let go (the weights stay where they are)."""
        for runner in runners:
            runner.release()
        model.kv = None
