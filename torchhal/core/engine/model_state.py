"""A caller's model put back as it was when an engine's construction fails.

Construction moves and casts the model (`model.to(device, dtype)`), switches it to eval
mode, gives it a KV cache, and may route its projections to the platform's kernel and
compile its layers; graph capture, the last step, can still fail (out of memory, say).
A cast is lossy (float32 to bfloat16), so moving the model back is not enough: the
originals are kept (references only, no copies) and put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

_NO_ATTRIBUTE = object()


class ModelState:
    """Every submodule's parameters, buffers and training flag, the model's `kv`, and its
    `layer_math` settings (the linear kernel and compiled functions of a `LlamaDecoder`),
    as they are now. Holding them keeps the original tensors alive until `restore` or until
    this record is dropped."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modules = [(module, dict(module._parameters), dict(module._buffers), module.training)
                        for module in model.modules()]
        # A cast swaps a parameter's `.data` in place (the Parameter object stays): keep the tensor too.
        self.data = [(parameter, parameter.data) for _, parameters, _, _ in self.modules
                     for parameter in parameters.values() if parameter is not None]
        self.kv: object = getattr(model, "kv", _NO_ATTRIBUTE)
        layer_math = getattr(model, "layer_math", None)
        self.layer_math: tuple[Any, dict[str, Any]] | None = (
            (layer_math, dict(vars(layer_math))) if hasattr(layer_math, "__dict__") else None)

    def restore(self) -> None:
        for module, parameters, buffers, training in self.modules:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)
            module.training = training
        for parameter, data in self.data:
            parameter.data = data
        if self.kv is _NO_ATTRIBUTE:
            self.model.__dict__.pop("kv", None)
        else:
            self.model.kv = self.kv  # type: ignore[assignment]
        if self.layer_math is not None:
            layer_math, settings = self.layer_math
            vars(layer_math).clear()
            vars(layer_math).update(settings)


@contextlib.contextmanager
def restored_on_failure(model: Any) -> Iterator[None]:
    """Put `model` (a caller's `nn.Module`; anything else is left alone) back as it was if
    the block raises."""
    saved = ModelState(model) if isinstance(model, nn.Module) else None
    try:
        yield
    except BaseException:
        if saved is not None:
            saved.restore()
        raise
