"""The CUDA plugin's Triton attention on a real GPU. Skipped, with the reason, elsewhere.

The conformance clause (`torchhal conformance --platform cuda -k test_attention`) checks
the kernels case by case; these tests check what the engine will wire together.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import torchhal
from torchhal.attention import SCRATCH_BLOCK, AttentionSpec, ReferenceBackend, build_metadata, new_kv_cache

has_cuda = torch.cuda.is_available() and torch.version.cuda is not None
has_triton = importlib.util.find_spec("triton") is not None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (has_cuda and has_triton),
                                                  reason="needs a CUDA GPU and Triton (none here)")]


@pytest.fixture
def cuda():
    return torchhal.get_platform("cuda")


def test_cuda_chooses_its_triton_backend_for_llama_shapes_and_says_why(cuda):
    choice = cuda.choose_attention(AttentionSpec(32, 8, 128, torch.bfloat16, 16, needs_graph=True))
    assert choice.name == "triton-paged" and "supports this model" in choice.why
    odd = cuda.choose_attention(AttentionSpec(8, 8, 72, torch.bfloat16, 16))
    assert odd.name == "reference" and "head_dim 72 is not among" in odd.why


def test_one_graph_writes_kv_at_slots_worked_out_on_the_device_and_attends(cuda):
    """The engine's decode step, captured once: every live row grows by a token and its slot is
    worked out on the device, this step's K/V are written there, then attended; replayed for 40
    steps across block boundaries against the reference."""
    backend = cuda.choose_attention(AttentionSpec(8, 2, 128, torch.bfloat16, 16, needs_graph=True)).backend
    device = cuda.device(0)
    block_size, capacity = 16, 4
    k_cache, v_cache = new_kv_cache(64, block_size, 2, 128, torch.bfloat16, device)
    k_cache.normal_()
    v_cache.normal_()
    # Rows 0 and 2 hold 16 and 14 tokens; rows 1 and 3 stay padded. No host copies: the
    # lengths change on the device, as the decode graph's do.
    built = build_metadata([[1], [], [5], []], [16, 0, 14, 0], [1] * capacity, block_size, device, max_blocks=8)
    meta = dataclasses.replace(built, host_seq_lens=None, host_query_start=None)
    meta.block_tables[0, :4] = torch.arange(1, 5, dtype=torch.int32)  # the blocks they grow into, ahead
    meta.block_tables[2, :4] = torch.arange(5, 9, dtype=torch.int32)
    live = meta.seq_lens > 0
    query = torch.zeros(capacity, 8, 128, dtype=torch.bfloat16, device=device)
    key = torch.zeros(capacity, 2, 128, dtype=torch.bfloat16, device=device)
    value = torch.zeros_like(key)
    out = torch.empty_like(query)

    def step() -> None:
        meta.seq_lens.add_(live.to(torch.int32))
        position = (meta.seq_lens - 1).clamp(min=0).to(torch.int64)
        block = meta.block_tables.gather(1, (position // block_size)[:, None]).squeeze(1).to(torch.int64)
        meta.slot_mapping.copy_(torch.where(live, block * block_size + position % block_size,
                                            SCRATCH_BLOCK * block_size))
        backend.write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
        backend.decode(query, k_cache, v_cache, meta, scale=128**-0.5, out=out)

    graphs = cuda.graph_support
    graph = graphs.graph_class()
    saved = (meta.seq_lens.clone(), k_cache.clone(), v_cache.clone())
    stream = cuda.new_stream(0)
    stream.wait_stream(cuda.current_stream(0))
    with cuda.use_stream(stream):
        step()  # compile outside the graph
    cuda.current_stream(0).wait_stream(stream)
    meta.seq_lens.copy_(saved[0])
    k_cache.copy_(saved[1])
    v_cache.copy_(saved[2])
    with graphs.capture(graph, graphs.new_pool(), stream):
        step()
    cuda.current_stream(0).wait_stream(stream)
    reference = ReferenceBackend()
    for grown in range(1, 41):
        for tensor in (query, key, value):
            tensor.normal_()
        graph.replay()
        cuda.synchronize(0)
        assert meta.seq_lens.tolist() == [16 + grown, 0, 14 + grown, 0]
        expected = reference.decode(query, k_cache, v_cache, meta, scale=128**-0.5)
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
        assert out[[1, 3]].abs().max() == 0
        # The token just written is where the device-built slot says.
        for row in (0, 2):
            slot = int(meta.slot_mapping[row])
            torch.testing.assert_close(k_cache.view(-1, 2, 128)[slot], key[row])


def test_a_long_context_decode_is_split_and_matches_the_reference(cuda):
    from torchhal.plugins.cuda_attention import TritonPagedAttention, decode_splits

    device = cuda.device(0)
    context, block_size = 16384, 16
    blocks = context // block_size
    k_cache, v_cache = new_kv_cache(blocks + 1, block_size, 8, 128, torch.bfloat16, device)
    k_cache.normal_()
    v_cache.normal_()
    order = (torch.randperm(blocks) + 1).tolist()
    meta = build_metadata([order], [context], [1], block_size, device)
    query = torch.randn(1, 32, 128, dtype=torch.bfloat16, device=device)
    assert decode_splits(1, 8, context, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    for window in (None, 3000):
        got = TritonPagedAttention().decode(query, k_cache, v_cache, meta, scale=128**-0.5, sliding_window=window)
        expected = ReferenceBackend().decode(query, k_cache, v_cache, meta, scale=128**-0.5, sliding_window=window)
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_whole_prompts_take_the_dense_kernel_and_equal_the_reference(cuda, monkeypatch):
    """Prompts with nothing cached before them run a dense kernel per prompt; chunks after
    cached tokens stay on the paged kernel. Both equal the reference."""
    from torchhal.attention import write_kv

    backend = cuda.choose_attention(AttentionSpec(32, 8, 128, torch.bfloat16, 16)).backend
    device, block_size = cuda.device(0), 16
    lengths = [1, 300, 4096]
    k_cache, v_cache = new_kv_cache(1 + sum(-(-n // block_size) for n in lengths), block_size, 8, 128,
                                    torch.bfloat16, device)
    tables, next_block = [], 1
    for n in lengths:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    dense_runs: list[list[tuple[int, int, int]]] = []
    real = type(backend)._flash_prefill
    monkeypatch.setattr(type(backend), "_flash_prefill",
                        staticmethod(lambda *a: (dense_runs[-1].append(a[3]), real(*a))[1]))
    for query_lens in ([1, 300, 4096], [1, 44, 1024], [1, 300, 1024]):  # whole; chunks; whole and a chunk
        dense_runs.append([])
        meta = build_metadata(tables, lengths, query_lens, block_size, device)
        tokens = sum(query_lens)
        key = torch.randn(tokens, 8, 128, device=device, dtype=torch.bfloat16)
        write_kv(k_cache, v_cache, key, torch.randn_like(key), meta.slot_mapping)
        query = torch.randn(tokens, 32, 128, device=device, dtype=torch.bfloat16)
        out = torch.full_like(query, float("nan"))
        backend.prefill(query, k_cache, v_cache, meta, scale=128**-0.5, out=out)
        expected = ReferenceBackend().prefill(query, k_cache, v_cache, meta, scale=128**-0.5)
        error = (out.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, (query_lens, error)
    # The one-token request is a whole prompt in every step; the others only while they are.
    assert dense_runs == [[(0, 1, 1), (1, 1, 300), (301, 1, 4096)], [(0, 1, 1)], [(0, 1, 1), (1, 1, 300)]]


def test_equal_whole_prompts_share_one_dense_call_and_equal_the_reference(cuda, monkeypatch):
    """Adjacent whole prompts of one length run as one batched SDPA call (a step of 32 short
    prompts launches once a layer, not 32 times); a chunk between them keeps them apart. The
    output equals the reference and every query row is written."""
    from torchhal.attention import write_kv
    from torchhal.plugins import cuda_flash

    backend = cuda.choose_attention(AttentionSpec(32, 8, 128, torch.bfloat16, 16)).backend
    device, block_size = cuda.device(0), 16
    lengths = [33, 33, 33, 200, 33, 33, 7]
    query_lens = [33, 33, 33, 40, 33, 33, 7]  # the 200-token request is a chunk after 160 cached tokens
    tables, next_block = [], 1
    for n in lengths:
        count = -(-n // block_size)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    k_cache, v_cache = new_kv_cache(next_block, block_size, 8, 128, torch.bfloat16, device)
    k_cache.normal_(), v_cache.normal_()
    meta = build_metadata(tables, lengths, query_lens, block_size, device)
    tokens = sum(query_lens)
    key = torch.randn(tokens, 8, 128, device=device, dtype=torch.bfloat16)
    write_kv(k_cache, v_cache, key, torch.randn_like(key), meta.slot_mapping)
    query = torch.randn(tokens, 32, 128, device=device, dtype=torch.bfloat16)
    batches: list[int] = []
    real = cuda_flash.dense_causal
    monkeypatch.setattr(cuda_flash, "dense_causal", lambda q, *a: (batches.append(q.shape[0]), real(q, *a))[1])
    out = torch.full_like(query, float("nan"))
    backend.prefill(query, k_cache, v_cache, meta, scale=128**-0.5, out=out)
    assert batches == [3, 2, 1]  # three 33s; the two 33s after the chunk; the 7
    expected = ReferenceBackend().prefill(query, k_cache, v_cache, meta, scale=128**-0.5)
    assert not out.isnan().any()
    error = (out.float() - expected.float()).norm() / expected.float().norm()
    assert error < 1e-2, error


def test_a_step_of_one_dense_call_returns_its_output_without_a_copy(cuda, monkeypatch):
    """Without `out`, a step whose whole prompts are one dense call returns the kernel's own
    output (a view of it: no copy into a buffer of the step); with `out`, or with two calls,
    the rows are written into one tensor. Both equal the reference."""
    from torchhal.attention import write_kv
    from torchhal.plugins import cuda_flash

    backend = cuda.choose_attention(AttentionSpec(32, 8, 128, torch.bfloat16, 16)).backend
    device, block_size = cuda.device(0), 16
    outputs: list[int] = []
    real = cuda_flash.dense_causal
    monkeypatch.setattr(cuda_flash, "dense_causal",
                        lambda *a: (lambda o: (outputs.append(o.data_ptr()), o)[1])(real(*a)))
    for lengths, one_call in (([512, 512, 512], True), ([512, 256], False)):
        tables, next_block = [], 1
        for n in lengths:
            tables.append(list(range(next_block, next_block + n // block_size)))
            next_block += n // block_size
        k_cache, v_cache = new_kv_cache(next_block, block_size, 8, 128, torch.bfloat16, device)
        meta = build_metadata(tables, lengths, lengths, block_size, device)
        tokens = sum(lengths)
        key = torch.randn(tokens, 8, 128, device=device, dtype=torch.bfloat16)
        write_kv(k_cache, v_cache, key, torch.randn_like(key), meta.slot_mapping)
        query = torch.randn(tokens, 32, 128, device=device, dtype=torch.bfloat16)
        expected = ReferenceBackend().prefill(query, k_cache, v_cache, meta, scale=128**-0.5)
        outputs.clear()
        returned = backend.prefill(query, k_cache, v_cache, meta, scale=128**-0.5)
        assert len(outputs) == (1 if one_call else 2)
        assert (returned.data_ptr() == outputs[0]) == one_call  # the kernel's own output, or a buffer of the step
        into = torch.full_like(query, float("nan"))
        assert backend.prefill(query, k_cache, v_cache, meta, scale=128**-0.5, out=into) is into
        for got in (returned, into):
            assert got.shape == query.shape and got.is_contiguous()
            error = (got.float() - expected.float()).norm() / expected.float().norm()
            assert error < 1e-2, (lengths, error)
        assert torch.equal(returned, into)


def test_whole_prompts_attend_over_the_steps_own_kv_in_place(cuda, monkeypatch):
    """Given the step's K/V (as engines pass them: views into the projections' outputs), whole
    prompts read them where they are, not back out of the cache: with those slots of the cache
    holding NaN the output still equals the reference over the real cache, and nothing is
    gathered. A chunk after cached tokens still reads the cache. Without them, the cache."""
    from torchhal.attention import write_kv

    backend = cuda.choose_attention(AttentionSpec(32, 8, 128, torch.bfloat16, 16)).backend
    assert backend.capability.step_kv
    device, block_size = cuda.device(0), 16
    lengths, query_lens = [512, 512, 300, 200], [512, 512, 300, 40]  # three whole prompts, then a chunk
    tables, next_block = [], 1
    for n in lengths:
        tables.append(list(range(next_block, next_block + -(-n // block_size))))
        next_block += len(tables[-1])
    k_cache, v_cache = new_kv_cache(next_block, block_size, 8, 128, torch.bfloat16, device)
    k_cache.normal_(), v_cache.normal_()
    meta = build_metadata(tables, lengths, query_lens, block_size, device)
    tokens = sum(query_lens)
    rotated = torch.randn(tokens, 40, 128, device=device, dtype=torch.bfloat16)  # q and k heads, rotated
    projected = torch.randn(tokens, 48, 128, device=device, dtype=torch.bfloat16)  # q, k, v heads
    query, key, value = rotated[:, :32], rotated[:, 32:], projected[:, 40:]
    write_kv(k_cache, v_cache, key, value, meta.slot_mapping)
    expected = ReferenceBackend().prefill(query, k_cache, v_cache, meta, scale=128**-0.5)
    whole = meta.slot_mapping[: 512 + 512 + 300]
    poisoned_k, poisoned_v = k_cache.clone(), v_cache.clone()
    for cache in (poisoned_k, poisoned_v):
        cache.view(-1, 8, 128)[whole] = float("nan")
    gathered: list[int] = []
    real_index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select",
                        lambda self, *a: (gathered.append(self.shape[0]), real_index_select(self, *a))[1])
    got = backend.prefill(query, poisoned_k, poisoned_v, meta, scale=128**-0.5, key=key, value=value)
    assert not got.isnan().any()
    error = (got.float() - expected.float()).norm() / expected.float().norm()
    assert error < 1e-2, error
    slots = poisoned_k.shape[0] * block_size
    assert slots not in gathered  # no prompt's K/V read back out of the cache
    without = backend.prefill(query, poisoned_k, poisoned_v, meta, scale=128**-0.5)
    assert without[: 512 + 512 + 300].isnan().all()  # the cache it was told to read


def fa4_installed() -> bool:
    """The flash-attn-4 distribution itself (flash-attn 2 ships a `flash_attn` package too)."""
    import importlib.metadata

    try:
        importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return False
    return has_cuda and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not fa4_installed(), reason="needs the fa4 extra (flash-attn-4) and an sm_90 GPU")
def test_fa4_is_the_installed_packages_own_and_equals_sdpa_on_the_engines_views(monkeypatch):
    """With flash-attn-4 installed on an sm_90 device, long whole prompts take it: its signature
    is the one tests/test_cuda_flash.py checks the fake against, and on q/k/v as the engine
    passes them (views into the projections' outputs, grouped heads; and contiguous copies, as
    out of the cache) it equals SDPA, which serves the same call with TORCHHAL_CUDA_FA4=0. The
    scale is not FA4's default, so a dropped `softmax_scale` fails."""
    import inspect

    import flash_attn.cute

    from tests.test_cuda_flash import FA4_PARAMETERS
    from torchhal.plugins import cuda_flash

    assert tuple(inspect.signature(flash_attn.cute.flash_attn_func).parameters) == FA4_PARAMETERS
    count, length = 2, cuda_flash.MIN_LENGTH + 32
    rotated = torch.randn(count * length, 40, 128, device="cuda", dtype=torch.bfloat16)  # q and k heads
    projected = torch.randn(count * length, 48, 128, device="cuda", dtype=torch.bfloat16)  # q, k, v heads
    q = rotated[:, :32].view(count, length, 32, 128)
    for k, v in ((rotated[:, 32:].view(count, length, 8, 128), projected[:, 40:].view(count, length, 8, 128)),
                 (rotated[:, 32:].contiguous().view(count, length, 8, 128),
                  projected[:, 40:].contiguous().view(count, length, 8, 128))):
        outputs = {}
        for setting in ("1", "0"):
            monkeypatch.setenv("TORCHHAL_CUDA_FA4", setting)
            cuda_flash.KERNEL_CALLS.clear()
            outputs[setting] = cuda_flash.dense_causal(q, k, v, 0.1)
            assert cuda_flash.KERNEL_CALLS == {"fa4" if setting == "1" else "sdpa": 1}
        fa4, sdpa = outputs["1"].float(), outputs["0"].float()
        assert fa4.shape == sdpa.shape == (count, length, 32, 128)
        assert (fa4 - sdpa).norm() / sdpa.norm() < 1e-2
