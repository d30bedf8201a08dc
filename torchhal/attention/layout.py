"""The paged KV layout every attention backend reads, the metadata that addresses it, and the write.

Per layer, `k_cache` and `v_cache` are `[num_blocks, block_size, num_kv_heads, head_dim]`:
a token's K (or V) for all KV heads is one contiguous row, so a kernel reads a block's
head slice with one stride and the writer stores a step's tokens with one indexed copy.
Block `SCRATCH_BLOCK` (0) is never handed to a request: padded rows (a batch padded to a
graph bucket) write there, and unused block-table entries point there, so every table
entry is a valid index and no kernel needs a bounds branch for them.

A step's metadata (`PagedMetadata`) is device tensors: block tables, context lengths
(including this step's tokens), query offsets and the slots this step writes. Its
constructor is the one place metadata is checked: it refuses tensors unlike the fields it
documents, and lengths and offsets that do not fit them, from what the host knows without a
device sync (the builder's host copies, or the tensors themselves where they are in host
memory). Backends read what it admitted without checking it again. `build_metadata` makes
it from host lists, refusing block ids that are not a request's own.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from torchhal.values import as_index, as_indices, ceil_div, short_repr

#: The block padded rows write to and unused table entries point at; never a request's.
SCRATCH_BLOCK = 0
#: Lengths and block ids are int32 on the device.
INT32_END = 2**31

#: PagedMetadata's tensors as it documents them: (field, dims, dtype).
_TENSORS = (("block_tables", 2, torch.int32), ("seq_lens", 1, torch.int32), ("query_start", 1, torch.int32),
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
    max_query_len: at least the longest request's query count (a host int, for the launch
                  grid); 1 for decode.
    block_size:   the tokens a block of the cache holds, as the slots were worked out.
    host_seq_lens, host_query_start: host copies of seq_lens and query_start where the
                  builder had them (`build_metadata`; None for metadata worked out on the
                  device), so a backend can pick a kernel by shape without a device sync.

    A request's context fits its table row (seq_len <= max_blocks * block_size) and holds its
    queries (query count <= seq_len; a padded decode row has seq_len 0 and one query);
    query_start rises from 0 to num_tokens.
    """

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    block_size: int
    host_seq_lens: tuple[int, ...] | None = None
    host_query_start: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problem = self._layout_problem() or self._lengths_problem()
        if problem is not None:
            raise ValueError(f"PagedMetadata: {problem}")

    def _layout_problem(self) -> str | None:
        device = self.slot_mapping.device if isinstance(self.slot_mapping, torch.Tensor) else None
        for field, dims, dtype in _TENSORS:
            tensor = getattr(self, field)
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != dims or tensor.dtype != dtype:
                shown = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else repr(tensor)
                return f"{field} is {shown}; it must be a {dims}-D {dtype} tensor (build_metadata makes them so)"
            if tensor.device != device:
                return f"{field} is on {tensor.device} but slot_mapping on {device}; put the tensors on one device"
        if not self.block_tables.shape[0] == self.batch == self.query_start.shape[0] - 1:
            return (f"block_tables has {self.block_tables.shape[0]} rows and query_start {self.query_start.shape[0]} "
                    f"entries for {self.batch} seq_lens; give one table row per request and batch + 1 offsets")
        for field, least in (("block_size", 1), ("max_query_len", 0)):
            value = as_index(getattr(self, field))
            if value is None or value < least:
                return f"{field} is {short_repr(getattr(self, field))}; it must be an int >= {least}"
            object.__setattr__(self, field, value)
        return None

    def _lengths_problem(self) -> str | None:
        """What is wrong with the lengths and offsets as the host knows them: the host copies,
        else the tensors themselves where they are in host memory (never a device sync)."""
        on_host, batch, tokens = self.seq_lens.device.type == "cpu", self.batch, self.slot_mapping.shape[0]
        seq_lens = self.seq_lens.tolist() if self.host_seq_lens is None and on_host else self.host_seq_lens
        starts = self.query_start.tolist() if self.host_query_start is None and on_host else self.host_query_start
        counts = [0] * batch
        if starts is not None:
            counts = [last - first for first, last in pairwise(starts)]
            if len(starts) != batch + 1 or starts[0] != 0 or starts[-1] != tokens or min(counts, default=0) < 0:
                return (f"query_start is {short_repr(list(starts))}; it must rise from 0 to the step's {tokens} "
                        f"tokens (slot_mapping's entries) in {batch + 1} offsets")
            if max(counts, default=0) > self.max_query_len:
                return f"max_query_len is {self.max_query_len} but a request has {max(counts)} queries"
        if seq_lens is None:
            return None
        if len(seq_lens) != batch:
            return f"host_seq_lens has {len(seq_lens)} entries for a batch of {batch}"
        capacity = self.max_blocks * self.block_size
        for row, (seq_len, count) in enumerate(zip(seq_lens, counts, strict=True)):
            if not 0 <= seq_len <= capacity or (count > seq_len and not (seq_len == 0 and count == 1)):
                return (f"request {row} has seq_len {seq_len} and {count} queries; need 0 <= queries <= seq_len <= "
                        f"{capacity} (its table row: {self.max_blocks} blocks of {self.block_size}), or a padded row "
                        "(seq_len 0, at most one query)")
        return None

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
    sizes = {"num_blocks": num_blocks, "block_size": block_size, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    for label, value in sizes.items():
        least = 2 if label == "num_blocks" else 1  # block SCRATCH_BLOCK is no request's
        if (as_index(value) or 0) < least:  # numpy's integers too, as build_metadata takes them
            raise ValueError(f"new_kv_cache: {label} is {value!r}; pass an int >= {least}"
                             + (f" (block {SCRATCH_BLOCK} is scratch)" if least == 2 else ""))
    shape = tuple(as_index(value) or 0 for value in sizes.values())
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's K/V ([num_tokens, num_kv_heads, head_dim], any strides) into their
    slots (`slot_mapping`, from the step's metadata) of one layer's contiguous caches.

    One indexed copy per cache, no host sync: capturable in a device graph.
    """
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


def _block_ids(row: int, ids: Sequence[object]) -> array[int]:
    """A request's block ids as machine integers. The array's strict conversion refuses a float
    (or anything else that is not an integer) instead of truncating it, at C speed: it runs
    for every request of every step."""
    try:
        return array("q", ids)  # type: ignore[arg-type]
    except (TypeError, OverflowError):
        raise _bad_block(row, next(b for b in ids if not 1 <= (as_index(b) or 0) < INT32_END)) from None


def _bad_block(row: int, block: object) -> ValueError:
    return ValueError(f"build_metadata: request {row} has block id {block!r}; a block id is an int from 1 to "
                      f"2**31 - 1 (block {SCRATCH_BLOCK} is scratch)")


def _check_blocks(tables: torch.Tensor, ids: list[array[int]], first_written: list[int]) -> None:
    """Block ids of one step's requests (`ids[i]`: request i's blocks, from index
    `first_written[i]` on the ones this step writes; `tables`: the same, host [batch, width]
    int64, 0 past each row's blocks): each from 1 to 2**31 - 1, none twice in a table (two
    positions would share slots), and a block a request writes in no other request's table
    (requests may share the blocks they only read, a common prefix). The common case, no
    block repeated anywhere, costs one set union and three reductions, not a Python loop."""
    count = sum(map(len, ids))
    if not count:
        return
    if int(tables.min()) < 0 or int(tables.max()) >= INT32_END or int(tables.count_nonzero()) != count:
        row = next(i for i, blocks in enumerate(ids) if blocks and not 1 <= min(blocks) <= max(blocks) < INT32_END)
        raise _bad_block(row, next(b for b in ids[row] if not 1 <= b < INT32_END))
    if len(set().union(*ids)) == count:
        return
    owners = Counter(block for blocks in ids for block in set(blocks))  # only where some block repeats
    for row, blocks in enumerate(ids):
        if len(set(blocks)) < len(blocks):
            repeated = next(b for k, b in enumerate(blocks) if b in blocks[:k])
            raise ValueError(f"build_metadata: request {row} names block {repeated} twice; each block holds one "
                             "span of a request's tokens")
        shared = next((b for b in blocks[first_written[row]:] if owners[b] > 1), None)
        if shared is not None:
            raise ValueError(f"build_metadata: request {row} writes block {shared} this step, and another request's "
                             "table has it too; give each request the blocks it writes to itself")


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
    they come free). Request i's last `query_lens[i]` of `seq_lens[i]` tokens are this step's
    queries, its KV in the first ceil(seq_lens[i] / block_size) blocks of `block_tables[i]`;
    the tables are `max_blocks` wide (None: the longest request's).

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
    lengths, queries = as_indices(seq_lens, 0), as_indices(query_lens, 0)
    if lengths is None or queries is None or max(lengths, default=0) >= INT32_END:
        row = next(i for i, pair in enumerate(zip(seq_lens, query_lens, strict=True))
                   if as_indices(pair, 0) is None or pair[0] >= INT32_END)
        raise ValueError(f"build_metadata: request {row} has seq_len {seq_lens[row]!r} and query_len "
                         f"{query_lens[row]!r}; need ints 0 <= query_len <= seq_len < 2**31")
    need = max([ceil_div(n, size) for n in lengths], default=0)
    width = need if max_blocks is None else as_index(max_blocks)
    if width is None or width < need:
        raise ValueError(f"build_metadata: max_blocks is {max_blocks!r}, and the longest request needs {need} "
                         f"blocks of {size}; pass an int >= {need}, or None for that")
    width, batch, starts = max(width, 1), len(lengths), [0]
    blocks64 = torch.full((batch, width), SCRATCH_BLOCK, dtype=torch.int64)  # checked whole, then made int32
    requests: list[array[int]] = []
    for row, (blocks, seq_len, query_len) in enumerate(zip(block_tables, lengths, queries, strict=True)):
        used = ceil_div(seq_len, size)
        ids = list(blocks)[:used]
        if len(ids) < used:
            raise ValueError(f"build_metadata: request {row} ({seq_len} tokens) needs {used} blocks of {size}; "
                             f"its table is {short_repr(list(blocks))}")
        requests.append(_block_ids(row, ids))
        if used:
            blocks64[row, :used] = torch.frombuffer(requests[-1], dtype=torch.int64)
        starts.append(starts[-1] + query_len)
    # A request writes from the block of its first query on; one without queries writes nothing.
    first_written = [max(n - q, 0) // size if q else len(blocks)
                     for n, q, blocks in zip(lengths, queries, requests, strict=True)]
    _check_blocks(blocks64, requests, first_written)
    # One host buffer, one upload: the tables, then seq_lens, then query_start.
    host = torch.cat([blocks64.view(-1), torch.tensor(lengths, dtype=torch.int64), torch.tensor(starts)])
    uploaded = host.to(torch.int32).to(device, non_blocking=True)
    block_table = uploaded[: batch * width].view(batch, width)
    device_seq_lens = uploaded[batch * width : batch * width + batch]
    query_start = uploaded[batch * width + batch :]
    rows, positions = _token_rows_and_positions(device_seq_lens, query_start, starts[-1])
    columns = positions.clamp(min=0)
    slots = block_table[rows, columns // size].to(torch.int64) * size + columns % size
    padded = device_seq_lens[rows] == 0
    meta = PagedMetadata(
        block_tables=block_table,
        seq_lens=device_seq_lens,
        query_start=query_start,
        slot_mapping=slots.masked_fill_(padded, SCRATCH_BLOCK * size),
        max_query_len=max(queries, default=0),
        block_size=size,
        host_seq_lens=lengths,
        host_query_start=tuple(starts),
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


def decode_metadata_for_rows(meta: PagedMetadata, rows: torch.Tensor) -> PagedMetadata:
    """Decode metadata (one query per row) that attends from the step's query rows `rows`
    ([R] int64 token indices, on the metadata's device) alone: each row gets its request's
    block table and, as its context, the tokens up to and including its own. So
    `backend.decode(query[rows], ..., this)` equals `backend.prefill(query, ..., meta)[rows]`,
    and a layer that needs only some rows' outputs (the last layer, whose other rows nothing
    reads) attends for those alone. Worked out on the device, no host sync; the host copy of
    the contexts is not known."""
    request, position = _token_rows_and_positions(meta.seq_lens, meta.query_start, rows)
    count = int(rows.shape[0])
    return PagedMetadata(
        block_tables=meta.block_tables.index_select(0, request),
        seq_lens=(position + 1).to(torch.int32),
        query_start=torch.arange(count + 1, dtype=torch.int32, device=meta.query_start.device),
        slot_mapping=meta.slot_mapping.index_select(0, rows),
        max_query_len=1,
        block_size=meta.block_size,
        host_query_start=tuple(range(count + 1)),
    )


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
