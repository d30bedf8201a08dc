"""A group of parameters held in one pinned host buffer and copied to the device on demand.

On the device a block's parameters live either in a buffer the caller gives (a layerwise
ring slot, reused by layer after layer) or, without one, packed by granule: one head
buffer of a whole number of allocator granules holds the largest parameters that fit
(descending size, first fit, 16-byte aligned offsets) and each parameter left over gets a
tensor of its own. The caching allocator rounds a large request up to its granule and keeps
the remainder (under 1 MiB) inside the block, counted as allocated; a whole-granule request
is not rounded, and a parameter's own tensor is its own size. One head is one large segment:
once released, the allocator can carve it for the next stage's large activations, where the
freed segments of many per-parameter tensors (tens of MiB each) could not serve them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchhal.platforms import Platform
from torchhal.values import ceil_div

#: Allocation granule of PyTorch's device caching allocators (CUDA, ROCm and the vendor forks
#: of it round a large segment up to 2 MiB). A head of whole granules is not rounded; on an
#: allocator with another granule the cost is only a hole smaller than one parameter.
GRANULE = 2 << 20
#: Byte alignment of each parameter in the head: vectorized loads and cuBLAS fast paths.
ALIGNMENT = 16


@dataclass(frozen=True)
class PackedLayout:
    """Where a block's parameters go on the device for one element size."""

    #: elements of the head buffer (a whole number of granules), 0 for no head
    head_numel: int
    #: per parameter, in block order: its element offset in the head, or None for its own tensor
    offsets: tuple[int | None, ...]


def pack_layout(numels: list[int], element_size: int) -> PackedLayout:
    """Place parameters of `numels` elements into a head of whole granules: descending size
    (stable for equal sizes), each at the first aligned offset after the last one placed if
    it fits, else left for a tensor of its own. The head starts at floor(total / GRANULE)
    granules and is trimmed to the granules its placed parameters reach, so its unused end
    is less than a granule and than any parameter left out (plus the alignment)."""
    sizes = [n * element_size for n in numels]
    head_bytes = sum(sizes) // GRANULE * GRANULE
    offsets: list[int | None] = [None] * len(sizes)
    end = 0  # bytes of the head in use
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        start = ceil_div(end, ALIGNMENT) * ALIGNMENT
        if start + sizes[index] <= head_bytes:
            offsets[index] = start // element_size
            end = start + sizes[index]
    head_bytes = ceil_div(end, GRANULE) * GRANULE
    if not head_bytes:  # nothing placed (or only empty parameters): no head at all
        offsets = [None] * len(sizes)
    return PackedLayout(head_bytes // element_size, tuple(offsets))


class WeightBlock:
    """Parameters consolidated into one pinned host buffer; on the device, views of a given
    buffer or packed by granule (see the module docstring for why)."""

    def __init__(self, params: list[nn.Parameter], platform: Platform, device: torch.device) -> None:
        assert len({p.dtype for p in params}) == 1  # the strategies' check refused any other block
        self.params, self.platform, self.device = params, platform, device
        self.numel = sum(p.numel() for p in params)
        self.dtype = params[0].dtype
        host = torch.empty(self.numel, dtype=self.dtype)
        for view, p in zip(self._split(host), params, strict=True):
            view.copy_(p.data)
        self.host = platform.pin_memory(host)
        self.host_views = self._split(self.host)  # each parameter's slice of the pinned buffer
        self._point_params(self.host_views)
        #: while loaded, each parameter's device tensor (a view of the given buffer or of the
        #: head, or its own allocation); empty while the parameters point at the host copy
        self.device_tensors: list[torch.Tensor] = []
        self.ready: Any = None  # event recorded after the copy, or None when loaded synchronously
        #: bytes this block has copied host -> device since it was made (every load counts)
        self.copied_bytes = 0
        self._layouts: dict[int, PackedLayout] = {}  # per device element size

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

    def layout(self, dtype: torch.dtype) -> PackedLayout:
        """The packed device layout for `dtype` (sizes, hence placement, depend on it)."""
        element_size = dtype.itemsize
        if element_size not in self._layouts:
            self._layouts[element_size] = pack_layout([p.numel() for p in self.params], element_size)
        return self._layouts[element_size]

    def _packed(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Fresh device tensors for the parameters: views of one head of whole granules, own
        tensors for the rest."""
        layout = self.layout(dtype)
        head = torch.empty(layout.head_numel, dtype=dtype, device=self.device) if layout.head_numel else None
        tensors = []
        for p, offset in zip(self.params, layout.offsets, strict=True):
            if offset is None or head is None:
                tensors.append(torch.empty(p.shape, dtype=dtype, device=self.device))
            else:
                tensors.append(head[offset : offset + p.numel()].view(p.shape))
        return tensors

    def _point_params(self, tensors: list[torch.Tensor]) -> None:
        for p, tensor in zip(self.params, tensors, strict=True):
            p.data = tensor

    def load(self, stream: Any | None, into: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:
        """Copy to the device (converting to `dtype` when given); on `stream` with an event
        when given (prefetch), else in order. The host copy keeps its dtype, so a converted
        use never loses precision for the next one.

        `into` is a device buffer of that dtype to reuse (a layerwise ring slot): the
        parameters become views of it, filled by one copy. Without it the parameters are
        packed by granule for `dtype` (`layout`): views of one head buffer of whole
        granules, which the allocator does not round and can carve for other work once
        released, and own tensors for those that do not fit; each filled by its own copy.
        """
        assert not self.device_tensors  # the strategies load a released block only
        dtype = dtype or self.dtype
        compute = self.platform.current_stream(self.device.index)
        # Allocated (or last used) in compute order, so waiting on compute makes it safe to overwrite.
        copies: list[tuple[torch.Tensor, torch.Tensor]]  # (device destination, host source)
        if into is None:
            tensors = self._packed(dtype)
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
