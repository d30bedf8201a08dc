"""A group of parameters held in one pinned host buffer and copied to the device on demand.

On the device a block's parameters live either in a buffer the caller gives (a layerwise
ring slot, reused by layer after layer) or, without one, each in a tensor of its own. The
caching allocator rounds a large request up to its 2 MiB granule and does not split off a
remainder under 1 MiB, so one flat buffer for the whole block would hold up to a granule
more than the parameters; a request per parameter, at its shape and dtype, is what the
module's own `.to(device)` makes, so the device holds what it would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchhal.platforms import Platform


class WeightBlock:
    """Parameters consolidated into one pinned host buffer; on the device, views of a given
    buffer or one tensor per parameter (see the module docstring for why)."""

    def __init__(self, params: list[nn.Parameter], platform: Platform, device: torch.device) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            found = sorted(map(str, dtypes))
            raise ValueError(f"a weight block needs one dtype, got {found}; cast the component first")
        self.params, self.platform, self.device = params, platform, device
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        host = torch.empty(self.numel, dtype=self.dtype)
        for view, p in zip(self._split(host), params, strict=True):
            view.copy_(p.data)
        self.host = platform.pin_memory(host)
        self.host_views = self._split(self.host)  # each parameter's slice of the pinned buffer
        self._point_params(self.host_views)
        #: while loaded, each parameter's device tensor (a view of the given buffer, or its
        #: own allocation); empty while the parameters point at the host copy
        self.device_tensors: list[torch.Tensor] = []
        self.ready: Any = None  # event recorded after the copy, or None when loaded synchronously
        #: bytes this block has copied host -> device since it was made (every load counts)
        self.copied_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the device copy while loaded, else of the host copy."""
        source = self.device_tensors[0] if self.device_tensors else self.host
        return self.numel * source.element_size()

    @property
    def on_device(self) -> bool:
        return bool(self.device_tensors)

    @property
    def device_dtype(self) -> torch.dtype | None:
        return self.device_tensors[0].dtype if self.device_tensors else None

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of a flat buffer, in order."""
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def _point_params(self, tensors: list[torch.Tensor]) -> None:
        for p, tensor in zip(self.params, tensors, strict=True):
            p.data = tensor

    def load(self, stream: Any | None, into: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:
        """Copy to the device (converting to `dtype` when given); on `stream` with an event
        when given (prefetch), else in order. The host copy keeps its dtype, so a converted
        use never loses precision for the next one.

        `into` is a device buffer of that dtype to reuse (a layerwise ring slot): the
        parameters become views of it, filled by one copy. Without it each parameter gets
        its own tensor from the caching allocator, filled by its own copy: the same
        requests the module's own `.to(device)` makes, so no granule rounding of one
        block-sized buffer is added to the peak.
        """
        if self.device_tensors:
            return
        dtype = dtype or self.dtype
        compute = self.platform.current_stream(self.device.index)
        # Allocated (or last used) in compute order, so waiting on compute makes it safe to overwrite.
        copies: list[tuple[torch.Tensor, torch.Tensor]]  # (device destination, host source)
        if into is None:
            tensors = [torch.empty(p.shape, dtype=dtype, device=self.device) for p in self.params]
            copies = list(zip(tensors, self.host_views, strict=True))
        else:
            buffer = into[: self.numel]
            tensors = self._split(buffer)
            copies = [(buffer, self.host)]
        if stream is None:
            for destination, source in copies:
                destination.copy_(source, non_blocking=True)
            self.ready = None
        else:
            stream.wait_stream(compute)  # the block may still be read by queued compute work
            with self.platform.use_stream(stream):
                for destination, source in copies:
                    destination.copy_(source, non_blocking=True)
                self.ready = self.platform.new_event()
                self.ready.record(stream)
        self.device_tensors = tensors
        self.copied_bytes += self.nbytes
        self._point_params(tensors)

    def wait(self) -> bool:
        """Make compute wait for a prefetch; True if there was one to wait for."""
        if self.ready is None:
            return False
        self.ready.wait(self.platform.current_stream(self.device.index))
        self.ready = None
        return True

    def release(self) -> int:
        """Point the parameters back at host memory and drop the device copy; bytes dropped."""
        if not self.device_tensors:
            return 0
        # A prefetch nobody waited for may still be copying into the device tensors: compute
        # waits for it first, so the allocator cannot hand the memory out under a running copy.
        self.wait()
        nbytes = self.nbytes
        self._point_params(self.host_views)
        self.device_tensors, self.ready = [], None
        return nbytes
