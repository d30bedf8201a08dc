"""The profile's charge of device idle time to host work (`benchmarks/profile_long_context.py`):
each idle span goes to the innermost host event running then, on the launching thread."""

from __future__ import annotations

import json
from types import ModuleType

import pytest

from tests.benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("profile_long_context")


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict[str, object]:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "ph": "X"}


def test_idle_time_is_charged_to_the_innermost_host_event(bench, tmp_path):
    events = [
        _event("kernel", "gemm", 0, 10, tid=7), _event("gpu_memcpy", "Memcpy HtoD", 50, 10, tid=7),
        _event("kernel", "gemm", 62, 4, tid=7),  # a 2 us gap: under the threshold
        _event("python_function", "engine.py: step", 0, 100),
        _event("python_function", "layout.py: build_metadata", 12, 30),
        _event("cpu_op", "aten::copy_", 20, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 44, 4),
        _event("cuda_runtime", "cudaLaunchKernel", 1, 2),  # before the idle span
        _event("python_function", "other_thread.py: busy", 0, 100, tid=2),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report = bench.host_during_idle(path, least_us=5.0, step_us=1.0)
    charged = {row["name"]: row["us"] for row in report["host"]}
    assert report["spans"] == 1 and report["idle_us"] == pytest.approx(40.0)
    assert charged == {"engine.py: step": pytest.approx(6.0, abs=1),
                       "layout.py: build_metadata": pytest.approx(20, abs=1),
                       "aten::copy_": pytest.approx(10, abs=1), "cudaLaunchKernel": pytest.approx(4, abs=1)}
    assert sum(charged.values()) == pytest.approx(40.0)


def test_no_kernels_no_idle(bench, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_event("python_function", "x", 0, 10)]}))
    assert bench.host_during_idle(path) == {"idle_us": 0.0, "spans": 0, "host": []}


def test_call_edges_and_the_host_before_the_first_kernel(bench, tmp_path):
    """A call's time outside the kernels' span (host work before the first kernel, the wait after
    the last) is reported, and what the host ran before the first kernel is charged apart."""
    events = [
        _event("user_annotation", bench.CALL, 0, 100),
        _event("python_function", "requests.py: add", 2, 20),
        _event("python_function", "layout.py: build_metadata", 22, 8),
        _event("cuda_runtime", "cudaLaunchKernel", 30, 2),
        _event("kernel", "gemm", 40, 30, tid=7), _event("kernel", "norm", 70, 20, tid=7),
        _event("cuda_runtime", "cudaDeviceSynchronize", 34, 66),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert bench.call_edges(path) == {"call_us": 100.0, "before_first_kernel_us": 40.0, "after_last_kernel_us": 10.0}
    lead = bench.host_during_idle(path, least_us=5.0, step_us=1.0)["before_first_kernel"]
    charged = {row["name"]: row["us"] for row in lead["host"]}
    assert lead["us"] == 40.0
    assert charged == {"(no host event)": pytest.approx(4, abs=1), "requests.py: add": pytest.approx(20, abs=1),
                       "layout.py: build_metadata": pytest.approx(8, abs=1),
                       "cudaLaunchKernel": pytest.approx(2, abs=1),
                       "cudaDeviceSynchronize": pytest.approx(6, abs=1)}
    assert bench.CALL not in charged  # the annotation itself is no host work


def test_no_call_annotation_no_edges(bench, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": [_event("kernel", "gemm", 0, 10, tid=7),
                                                _event("cuda_runtime", "cudaLaunchKernel", 0, 1)]}))
    assert bench.call_edges(path) == {}
    assert "before_first_kernel" not in bench.host_during_idle(path)
