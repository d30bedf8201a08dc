"""A group of parameters held in one pinned host buffer and loaded into one device buffer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchhal.platforms import Platform


class WeightBlock:
    """Parameters consolidated into one pinned host buffer; loaded into one device buffer."""

    def __init__(self, params: list[nn.Parameter], platform: Platform, device: torch.device) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            found = sorted(map(str, dtypes))
            raise ValueError(f"a weight block needs one dtype, got {found}; cast the component first")
        self.params, self.platform, self.device = params, platform, device
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        host = torch.empty(self.numel, dtype=self.dtype)
        self._views(host, copy_from_params=True)
        self.host = platform.pin_memory(host)
        self._views(self.host, copy_from_params=False)
        self.device_buffer: torch.Tensor | None = None
        self.ready: Any = None  # event recorded after the copy, or None when loaded synchronously
        #: bytes this block has copied host -> device since it was made (every load counts)
        self.copied_bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the device copy while loaded, else of the host copy."""
        source = self.device_buffer if self.device_buffer is not None else self.host
        return self.numel * source.element_size()

    @property
    def on_device(self) -> bool:
        return self.device_buffer is not None

    @property
    def device_dtype(self) -> torch.dtype | None:
        return None if self.device_buffer is None else self.device_buffer.dtype

    def _views(self, flat: torch.Tensor, copy_from_params: bool) -> None:
        offset = 0
        for p in self.params:
            view = flat[offset : offset + p.numel()].view_as(p)
            if copy_from_params:
                view.copy_(p.data)
            p.data = view
            offset += p.numel()

    def load(self, stream: Any | None, into: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:
        """Copy to the device (converting to `dtype` when given); on `stream` with an event
        when given (prefetch), else in order. The host copy keeps its dtype, so a converted
        use never loses precision for the next one.

        `into` is a device buffer of that dtype to reuse (a layerwise ring slot); else one is allocated.
        """
        if self.device_buffer is not None:
            return
        dtype = dtype or self.dtype
        compute = self.platform.current_stream(self.device.index)
        # Allocated (or last used) in compute order, so waiting on compute makes it safe to overwrite.
        if into is None:
            into = torch.empty(self.numel, dtype=dtype, device=self.device)
        buffer = into[: self.numel]
        if stream is None:
            buffer.copy_(self.host, non_blocking=True)
            self.ready = None
        else:
            stream.wait_stream(compute)  # the block may still be read by queued compute work
            with self.platform.use_stream(stream):
                buffer.copy_(self.host, non_blocking=True)
                self.ready = self.platform.new_event()
                self.ready.record(stream)
        self.device_buffer = buffer
        self.copied_bytes += self.numel * buffer.element_size()
        self._views(buffer, copy_from_params=False)

    def wait(self) -> bool:
        """Make compute wait for a prefetch; True if there was one to wait for."""
        if self.ready is None:
            return False
        self.ready.wait(self.platform.current_stream(self.device.index))
        self.ready = None
        return True

    def release(self) -> int:
        """Point the parameters back at host memory and drop the device copy; bytes dropped."""
        if self.device_buffer is None:
            return 0
        # A prefetch nobody waited for may still be copying into the buffer: compute waits
        # for it first, so the allocator cannot hand the memory out under a running copy.
        self.wait()
        nbytes = self.nbytes
        self._views(self.host, copy_from_params=False)
        self.device_buffer, self.ready = None, None
        return nbytes
