"""The paged KV layout every attention backend reads, and the metadata that addresses it.

Per layer, `k_cache` and `v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`:
a token's K (or V) for all KV heads is one contiguous row, so a kernel reads a block's
head slice with one stride and the writer stores a step's tokens with one indexed copy.
Block `SCRATCH_BLOCK` (0) is never handed to a request: padded rows (a batch padded to a
graph bucket) write there, and unused block-table entries point there, so every table
entry is a valid index and no kernel needs a bounds branch for them.

A step's metadata (`PagedMetadata`) is device tensors only: block tables, context lengths
(including this step's tokens), query offsets and the slots this step writes.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from torchhal.values import as_index, ceil_div

#: The block padded rows write to and unused table entries point at; never a request's.
SCRATCH_BLOCK = 0


#: PagedMetadata's tensors as it documents them: (field, dims, dtype).
_METADATA_LAYOUT = (("block_tables", 2, torch.int32), ("seq_lens", 1, torch.int32), ("query_start", 1, torch.int32),
                    ("slot_mapping", 1, torch.int64))


@dataclass(frozen=True)
class PagedMetadata:
    """Where one step's queries sit and which cached tokens they attend to.

    block_tables: [batch, max_blocks] int32: request i's j-th block (SCRATCH_BLOCK where unused).
    seq_lens:     [batch] int32: context length including this step's tokens (0 = padded row).
    query_start:  [batch + 1] int32: request i's queries are rows query_start[i]:query_start[i+1]
                  of the step's query tensor; they are its last tokens (chunked prefill:
                  the earlier ones are already in the cache).
    slot_mapping: [num_tokens] int64: where each query token's K/V is written
                  (block * block_size + offset; a scratch slot for padded rows).
    max_query_len: the longest request's query count (a host int, for the launch grid);
                  1 for decode.
    host_seq_lens, host_query_start: host copies of seq_lens and query_start where the
                  builder had them (`build_metadata`; None on the device-advanced decode
                  path), so a backend can pick a kernel by shape without a device sync.
    block_size:   the tokens a block holds, as the slots were worked out (None: not recorded);
                  `check_call` refuses a cache whose blocks hold another count.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    host_seq_lens: tuple[int, ...] | None = None
    host_query_start: tuple[int, ...] | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        # Checked once where made, not at every layer's call: hand-built metadata unlike the
        # fields above failed deep in a kernel, or gave a wrong answer (a float length
        # truncated, a second table row ignored). Host facts only: no device sync.
        device = self.slot_mapping.device if isinstance(self.slot_mapping, torch.Tensor) else None
        for field, dims, dtype in _METADATA_LAYOUT:
            tensor = getattr(self, field)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims or tensor.dtype != dtype:
                shown = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else repr(tensor)
                raise ValueError(f"PagedMetadata: {field} is {shown}; it must be a {dims}-D {dtype} tensor "
                                 "(build_metadata makes them so)")
            if tensor.device != device:
                raise ValueError(f"PagedMetadata: {field} is on {tensor.device} but slot_mapping on {device}; put "
                                 "the metadata's tensors on one device")
        if self.block_tables.shape[0] != self.seq_lens.shape[0]:
            raise ValueError(f"PagedMetadata: block_tables has {self.block_tables.shape[0]} rows but seq_lens "
                             f"{self.seq_lens.shape[0]}; give one table row per request")

    @property
    def batch(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def max_blocks(self) -> int:
        return int(self.block_tables.shape[1])


def new_kv_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (k_cache, v_cache), zeroed, in the paged layout."""
    sizes = []
    for label, value in (("num_blocks", num_blocks), ("block_size", block_size),
                         ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        size = as_index(value)  # numpy's integers too, as build_metadata takes them
        if size is None or size < 1:
            raise ValueError(f"new_kv_cache: {label} is {value!r}; pass an int >= 1")
        sizes.append(size)
    if sizes[0] < 2:
        raise ValueError(f"new_kv_cache: num_blocks is {num_blocks}; pass >= 2 (block {SCRATCH_BLOCK} is scratch)")
    shape = tuple(sizes)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def check_write(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Raise one line naming the bad argument of a `write_kv` call (every writer checks these),
    before anything is written. The slots' range is checked where that costs no device sync
    (a host-resident slot_mapping); on a device the metadata builders guarantee it."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"write_kv: k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must be one "
                         "layer's pair from the same KV cache, [num_blocks, block_size, num_kv_heads, head_dim]")
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    if key.shape != value.shape or key.dim() != 3 or tuple(key.shape[1:]) != (heads, dim):
        raise ValueError(
            f"write_kv: key {tuple(key.shape)} / value {tuple(value.shape)} must both be "
            f"[num_tokens, {heads}, {dim}] to match the cache"
        )
    if slot_mapping.shape != key.shape[:1] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"write_kv: slot_mapping is {tuple(slot_mapping.shape)} {slot_mapping.dtype}; it needs one "
                         f"int64 slot per token ({key.shape[0]})")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("write_kv: k_cache / v_cache must be contiguous, one layer's pair as the KV cache holds "
                         "them (a slice of one is not: its slots are not where the metadata says)")
    slots = k_cache.shape[0] * k_cache.shape[1]
    bad = outside_on_host(slot_mapping, slots)
    if bad is not None:
        raise ValueError(f"write_kv: slot {bad} is outside the cache's {slots} slots (0..{slots - 1})")


def outside_on_host(ids: torch.Tensor, count: int) -> int | None:
    """An id of `ids` outside 0..count-1, where `ids` is in host memory; None when all are in
    range, or when `ids` is on a device (finding out there would cost a sync)."""
    if ids.device.type != "cpu" or not ids.numel():
        return None
    low, high = int(ids.min()), int(ids.max())
    return low if low < 0 else high if high >= count else None


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's K/V ([num_tokens, num_kv_heads, head_dim]) into their slots.

    One indexed copy per cache, no host sync: capturable in a device graph.
    """
    check_write(k_cache, v_cache, key, value, slot_mapping)
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


class PagedWriter:
    """`write_kv` as `AttentionBackend` asks it, through `write_kv` above: a base for backends
    whose kernels read the layout as it is (the reference and NPU backends; the CUDA backend
    replaces the write with one kernel of its own)."""

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(k_cache, v_cache, key, value, slot_mapping)


def _block_row(label: str, ids: list[Any]) -> tuple[torch.Tensor, array[int]]:
    """`ids` as an int64 tensor and as an array of plain ints, which the tensor shares (the
    repeat checks need values: a torch integer hashes by identity). The array's strict
    conversion refuses a float (or anything else that is not an integer) instead of
    truncating it, at C speed: it runs for every request of every step."""
    try:
        packed = array("q", ids)
    except (TypeError, OverflowError):
        raise _bad_block(label, next((b for b in ids if not 1 <= (as_index(b) or 0) < 2**31), ids)) from None
    return (torch.frombuffer(packed, dtype=torch.int64) if ids else torch.empty(0, dtype=torch.int64)), packed


def _bad_block(label: str, block: object) -> ValueError:
    return ValueError(f"{label} has block id {block!r}; a block id is an int from 1 to 2**31 - 1 (block "
                      f"{SCRATCH_BLOCK} is scratch)")


def _check_tables(label: Callable[[int], str], tables: torch.Tensor, ids: Sequence[Sequence[int]],
                  first_written: list[int]) -> None:
    """Block ids of one step's requests (`ids[i]`: request i's blocks, from index
    `first_written[i]` on the ones this step writes; `tables`: the same, host [batch, width]
    int64, 0 past each row's blocks): each from 1 to 2**31 - 1, none twice in a table (two
    positions would share slots), and a block a request writes in no other request's table
    (requests may share the blocks they only read, a common prefix). The common case, no
    block repeated anywhere, costs one set union and three reductions, not a Python loop."""
    counts = [len(row) for row in ids]
    if not sum(counts):
        return
    if int(tables.min()) < 0 or int(tables.max()) >= 2**31 or int(tables.count_nonzero()) != sum(counts):
        row = next(i for i, blocks in enumerate(ids) if blocks and not 1 <= min(blocks) <= max(blocks) < 2**31)
        raise _bad_block(label(row), next(b for b in ids[row] if not 1 <= b < 2**31))
    if len(set().union(*ids)) == sum(counts):
        return
    owners: dict[int, int] = {}
    for row, blocks in enumerate(ids):  # only where some block repeats
        if len(set(blocks)) < len(blocks):
            repeated = next(b for k, b in enumerate(blocks) if b in blocks[:k])
            raise ValueError(f"{label(row)} names block {repeated} twice; each block holds one span of a request's "
                             "tokens")
        for block in blocks:
            owners[block] = owners.get(block, 0) + 1
    for row, blocks in enumerate(ids):
        shared = next((b for b in blocks[first_written[row]:] if owners[b] > 1), None)
        if shared is not None:
            raise ValueError(f"{label(row)} writes block {shared} this step, and another request's table has it "
                             "too; give each request the blocks it writes to itself")


def build_metadata(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device,
    max_blocks: int | None = None,
) -> PagedMetadata:
    """`build_metadata_and_positions` without the positions."""
    return build_metadata_and_positions(block_tables, seq_lens, query_lens, block_size, device, max_blocks)[0]


def build_metadata_and_positions(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    query_lens: Sequence[int],
    block_size: int,
    device: torch.device,
    max_blocks: int | None = None,
) -> tuple[PagedMetadata, torch.Tensor]:
    """Metadata for one step from host lists, and its query tokens' absolute positions
    ([num_tokens] int64, the rotary positions too: the slots are worked out from them, so
    they come free). Request i's last `query_lens[i]` of `seq_lens[i]` tokens are this step's queries.

    A padded row has seq_len 0 and query_len 0 (prefill) or 1 (a decode row of a padded
    batch: it writes the scratch slot and outputs zeros).

    The host's work grows with the requests and their blocks, not with the tokens: the
    tables, lengths and offsets go to the device in one upload, and each token's write slot
    is worked out there (a 16k-token prompt would otherwise cost milliseconds of Python per
    step while the device waits).
    """
    if not len(block_tables) == len(seq_lens) == len(query_lens):
        raise ValueError(f"build_metadata: {len(block_tables)} block tables, {len(seq_lens)} seq_lens and "
                         f"{len(query_lens)} query_lens; pass one of each per request")
    size = as_index(block_size)
    if size is None or size < 1:
        raise ValueError(f"build_metadata: block_size is {block_size!r}; pass the cache's block size, an int >= 1")
    block_size = size
    lengths, queries = [as_index(n) for n in seq_lens], [as_index(n) for n in query_lens]
    for i, (seq_len, query_len) in enumerate(zip(lengths, queries, strict=True)):
        if seq_len is None or query_len is None or seq_len < 0 or query_len < 0 or seq_len >= 2**31 or (
                seq_len > 0 and query_len > seq_len):  # seq_lens are int32 on the device
            raise ValueError(f"build_metadata: request {i} has seq_len {seq_lens[i]!r} and query_len "
                             f"{query_lens[i]!r}; need ints 0 <= query_len <= seq_len < 2**31 (or seq_len 0 for a "
                             "padded row)")
    seq_lens, query_lens = cast(list[int], lengths), cast(list[int], queries)
    need = max([ceil_div(n, block_size) for n in seq_lens], default=0)
    widest = need if max_blocks is None else as_index(max_blocks)
    if widest is None or widest < 0:
        raise ValueError(f"build_metadata: max_blocks is {max_blocks!r}; pass an int >= 0 (the block tables' width), "
                         "or None for the longest request's")
    width = max(widest, 1)
    if width < need:
        raise ValueError(f"build_metadata: max_blocks={max_blocks} but a request of {max(seq_lens)} tokens needs "
                         f"{need} blocks of {block_size}; raise max_blocks")
    batch, starts = len(seq_lens), [0]
    # One host buffer, one upload: the tables, then seq_lens, then query_start.
    host = torch.full((batch * width + 2 * batch + 1,), SCRATCH_BLOCK, dtype=torch.int32)
    tables = host[: batch * width].view(batch, width)
    blocks64 = torch.zeros((batch, width), dtype=torch.int64)  # checked whole, then copied into `tables`
    requests: list[Sequence[int]] = []
    for i, (blocks, seq_len, query_len) in enumerate(zip(block_tables, seq_lens, query_lens, strict=True)):
        used = ceil_div(seq_len, block_size)
        ids = list(blocks)[:used]
        if len(ids) < used:
            raise ValueError(f"build_metadata: request {i} ({seq_len} tokens) needs {used} blocks of {block_size}; "
                             f"its table is {list(blocks)}")
        blocks64[i, :used], plain = _block_row(f"build_metadata: request {i}", ids)
        requests.append(plain)
        starts.append(starts[-1] + query_len)
    # A request writes from the block of its first query on; one without queries writes nothing.
    first_written = [(n - q) // block_size if q else len(blocks)
                     for n, q, blocks in zip(seq_lens, query_lens, requests, strict=True)]
    _check_tables(lambda row: f"build_metadata: request {row}", blocks64, requests, first_written)
    tables.copy_(blocks64)
    host[batch * width : batch * width + batch] = torch.tensor(list(seq_lens), dtype=torch.int32)
    host[batch * width + batch :] = torch.tensor(starts, dtype=torch.int32)
    uploaded = host.to(device, non_blocking=True)
    block_table = uploaded[: batch * width].view(batch, width)
    device_seq_lens = uploaded[batch * width : batch * width + batch]
    query_start = uploaded[batch * width + batch :]
    rows, positions = _token_rows_and_positions(device_seq_lens, query_start, starts[-1])
    columns = positions.clamp(min=0)
    slots = block_table[rows, columns // block_size].to(torch.int64) * block_size + columns % block_size
    padded = device_seq_lens[rows] == 0
    meta = PagedMetadata(
        block_tables=block_table,
        seq_lens=device_seq_lens,
        query_start=query_start,
        slot_mapping=slots.masked_fill_(padded, SCRATCH_BLOCK * block_size),
        max_query_len=max(query_lens, default=0),
        host_seq_lens=tuple(seq_lens),
        host_query_start=tuple(starts),
        block_size=block_size,
    )
    return meta, positions


def _token_rows_and_positions(seq_lens: torch.Tensor, query_start: torch.Tensor,
                              tokens: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token's request row and absolute position (int64 each), on the metadata's
    device with no host sync, for the step's first `tokens` tokens or for the token indices
    given: a row's queries are its last tokens, so token t of row r sits at
    seq_lens[r] - (query_start[r + 1] - t) (-1 for a padded decode row)."""
    if isinstance(tokens, int):
        tokens = torch.arange(tokens, dtype=torch.int64, device=query_start.device)
    rows = torch.searchsorted(query_start[1:], tokens, right=True)
    return rows, seq_lens[rows].to(torch.int64) - (query_start[rows + 1].to(torch.int64) - tokens)


def check_rows(label: str, rows: object, num_tokens: int, device: torch.device) -> None:
    """Raise one line naming a bad `rows` argument: [R] int64 token indices on `device`, each
    in 0..num_tokens-1. The range is checked where that costs no device sync (host-resident
    rows, or a CPU step); on a device the engine's own rows are right by construction."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype != torch.int64:
        shown = f"{tuple(rows.shape)} {rows.dtype}" if isinstance(rows, torch.Tensor) else repr(rows)
        raise ValueError(f"{label}: rows is {shown}; pass a 1-D int64 tensor of token indices")
    if rows.device != device:
        raise ValueError(f"{label}: rows is on {rows.device} but the step's tensors are on {device}; move it there")
    if rows.device.type == "cpu" and rows.numel():
        low, high = int(rows.min()), int(rows.max())
        if low < 0 or high >= num_tokens:
            raise ValueError(f"{label}: row {low if low < 0 else high} is outside the step's {num_tokens} tokens "
                             f"(0..{num_tokens - 1})")


def decode_metadata_for_rows(meta: PagedMetadata, rows: torch.Tensor) -> PagedMetadata:
    """Decode metadata (one query per row) that attends from the step's query rows `rows`
    ([R] int, device) alone: each row gets its request's block table and, as its context,
    the tokens up to and including its own. So `backend.decode(query[rows], ..., this)`
    equals `backend.prefill(query, ..., meta)[rows]`, and a layer that needs only some rows'
    outputs (the last layer, whose other rows nothing reads) attends for those alone.
    Worked out on the device, no host sync; the host copy of the contexts is not known."""
    check_rows("decode_metadata_for_rows", rows, int(meta.slot_mapping.shape[0]), meta.slot_mapping.device)
    request, position = _token_rows_and_positions(meta.seq_lens, meta.query_start, rows)
    count = int(rows.shape[0])
    return PagedMetadata(
        block_tables=meta.block_tables.index_select(0, request),
        seq_lens=(position + 1).to(torch.int32),
        query_start=torch.arange(count + 1, dtype=torch.int32, device=meta.query_start.device),
        slot_mapping=meta.slot_mapping.index_select(0, rows),
        max_query_len=1,
        host_query_start=tuple(range(count + 1)),
        block_size=meta.block_size,
    )
