"""The CUDA plugin's Triton kernels, run on the CPU by Triton's interpreter
(TRITON_INTERPRET=1), against the reference on the conformance clause's layouts. Skipped
where Triton is not installed; the same kernels run compiled in tests/test_attention_gpu.py.
Head dim 64 here and 128 in the compiled runs: both head dims the CUDA backend declares."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest


def interpreter_gap() -> str | None:
    """Why this Triton's interpreter cannot run the kernels, or None."""
    if importlib.util.find_spec("triton") is None:
        return "needs Triton (not installed)"
    import triton

    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if version < (3, 9):  # checked: 3.6 raises on a loop bound loaded from memory, 3.9 runs
        return f"Triton {triton.__version__}'s interpreter cannot take loop bounds loaded from memory (3.9's can)"
    return None


pytestmark = pytest.mark.skipif(interpreter_gap() is not None, reason=str(interpreter_gap()))

SCRIPT = textwrap.dedent("""
    from dataclasses import replace
    import torch
    from torchhal.conformance_tests.test_attention import DECODE_CASES, PREFILL_CASES, TOLERANCE, paged_layout
    from torchhal.attention import ReferenceBackend
    from torchhal.plugins import cuda_attention

    cuda_attention._multiprocessors = lambda index: 132  # no GPU to ask
    cuda_attention.MIN_TOKENS_PER_SPLIT = {min_split}  # small enough that decode splits these contexts
    triton_backend, reference = cuda_attention.TritonPagedAttention(), ReferenceBackend()
    head_dim_64 = replace(triton_backend.capability, head_dims=(64,))  # the clause's layouts at head dim 64
    for mode, cases in (("decode", DECODE_CASES), ("prefill", PREFILL_CASES)):
        for name, case in cases.items():
            layout = paged_layout(case, torch.float32, head_dim_64, torch.device("cpu"), seed=len(name))
            kwargs = dict(scale=layout.scale, sliding_window=case.window, soft_cap=case.soft_cap)
            expected = getattr(reference, mode)(layout.query, layout.k_cache, layout.v_cache, layout.meta, **kwargs)
            got = getattr(triton_backend, mode)(layout.query, layout.k_cache, layout.v_cache, layout.meta, **kwargs)
            error = float((got - expected).abs().max())
            assert error < TOLERANCE[torch.float32][0], f"{{mode}} {{name}}: max error {{error}}"
            print("ok", mode, name)
    layout = paged_layout(PREFILL_CASES["padded_rows"], torch.float32, head_dim_64, torch.device("cpu"), seed=7)
    tokens, heads = layout.meta.slot_mapping.shape[0], layout.k_cache.shape[2]
    fused = torch.randn(tokens, 4 * heads, 64)  # K and V as views into one projection: strided rows
    key, value = fused[:, 2 * heads : 3 * heads], fused[:, 3 * heads :]
    expected_k, expected_v = layout.k_cache.clone(), layout.v_cache.clone()
    reference.write_kv(expected_k, expected_v, key, value, layout.meta.slot_mapping)
    triton_backend.write_kv(layout.k_cache, layout.v_cache, key, value, layout.meta.slot_mapping)
    for got, want in ((layout.k_cache, expected_k), (layout.v_cache, expected_v)):
        assert torch.equal(got[1:].nan_to_num(7.0), want[1:].nan_to_num(7.0)), "write_kv"  # block 0: scratch
    print("ok write_kv")
""")


@pytest.mark.parametrize("min_split", [16, 1 << 20], ids=["split_decode", "one_split"])
def test_triton_kernels_match_the_reference_under_the_interpreter(min_split):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(min_split=min_split)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert out.stdout.count("ok ") == 17
