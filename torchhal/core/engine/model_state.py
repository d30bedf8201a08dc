"""A caller's model put back as it was when an engine's construction fails.

Construction moves and casts the model (`model.to(device, dtype)`), switches it to eval
mode, gives it a KV cache (and, under tensor parallel, a communicator), and may route its
projections to the platform's kernel and compile its layers; graph capture, the last
step, can still fail (out of memory, say). A cast is lossy (float32 to bfloat16), so
moving the model back is not enough: the originals are kept (references only, no copies)
and put back.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

_MODULE_TABLES = ("_parameters", "_buffers", "_modules")


class ModelState:
    """Every submodule's parameters (with their tensors and gradients: a cast swaps both in
    place), buffers, children and plain attributes (training flag, `kv`, a communicator),
    and the settings of each `layer_math` (a `LlamaDecoder`'s linear kernel and compiled
    functions), as they are now. Holding them keeps the original tensors alive until
    `restore` or until this record is dropped."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [(module, {table: dict(vars(module)[table]) for table in _MODULE_TABLES},
                         {k: v for k, v in vars(module).items() if k not in _MODULE_TABLES})
                        for module in model.modules()]
        self.parameters = [(parameter, parameter.data, parameter.grad,
                            None if parameter.grad is None else parameter.grad.data)
                           for parameter in {id(p): p for p in model.parameters()}.values()]
        layer_maths = {id(m.layer_math): m.layer_math for m in model.modules() if hasattr(m, "layer_math")}
        self.layer_maths = [(math, dict(vars(math))) for math in layer_maths.values() if hasattr(math, "__dict__")]

    def restore(self) -> None:
        for module, tables, attributes in self.modules:
            for table, entries in tables.items():
                vars(module)[table].clear()
                vars(module)[table].update(entries)
            for name in [k for k in vars(module) if k not in _MODULE_TABLES and k not in attributes]:
                del vars(module)[name]  # added by construction (a cached program, say)
            vars(module).update(attributes)
        for parameter, data, grad, grad_data in self.parameters:
            parameter.data = data
            if grad is not None and grad_data is not None:
                grad.data = grad_data
            parameter.grad = grad
        for math, settings in self.layer_maths:
            vars(math).clear()
            vars(math).update(settings)

    def follow_moves(self, moved: dict[int, torch.Tensor]) -> None:
        """Storages of the model's weights were copied elsewhere unchanged (into the engine's
        regions; `moved`: old storage address -> the copy's bytes, uint8): a restore puts back
        views of the copies, so the originals need not be held (which would double the weights'
        memory until the engine is built)."""
        def follow(data: torch.Tensor) -> torch.Tensor:
            base = moved.get(data.untyped_storage().data_ptr())
            if base is None:
                return data
            typed = base.view(data.dtype)
            return typed.as_strided(data.shape, data.stride(), typed.storage_offset() + data.storage_offset())

        self.parameters = [(parameter, follow(data), grad, grad_data)
                           for parameter, data, grad, grad_data in self.parameters]

    def held_bytes(self, device: torch.device) -> int:
        """Bytes on `device` that only this record keeps alive: originals the model no longer
        holds (a cast replaced them), which the cast would otherwise have freed."""
        def on_device(t: torch.Tensor) -> bool:  # `cpu` and `cpu:0` are one device
            return t.device.type == device.type and (t.device.index or 0) == (device.index or 0)

        def storages(tensors: Iterator[torch.Tensor | None]) -> dict[int, int]:
            return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if t is not None and on_device(t)}

        kept = storages(t for _, data, _, grad_data in self.parameters for t in (data, grad_data))
        kept.update(storages(t for _, tables, _ in self.modules for t in tables["_buffers"].values()))
        model = self.modules[0][0]
        live = storages(t for p in model.parameters() for t in (p.data, p.grad))
        live.update(storages(model.buffers()))
        return sum(size for pointer, size in kept.items() if pointer not in live)


@contextlib.contextmanager
def restored_on_failure(model: Any) -> Iterator[ModelState | None]:
    """Put `model` back as it was if the block raises; yields the record (None for a model
    that is not an `nn.Module`: it is left as the block leaves it)."""
    saved = ModelState(model) if isinstance(model, nn.Module) else None
    try:
        yield saved
    except BaseException:
        if saved is not None:
            try:
                saved.restore()
            except Exception as failed:  # the construction's error stays the one raised
                warnings.warn(f"engine construction failed, and putting the model back failed too: {failed!r}",
                              RuntimeWarning, stacklevel=3)
        raise
