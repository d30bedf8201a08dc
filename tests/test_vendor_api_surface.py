"""The vendor API names the built-in plugins use, and the fakes define, exist in the real packages.

The mapping tests (test_vendor_mapping.py) prove a plugin calls the names its fake
defines; this proves those names and call signatures are the vendors' own, against
snapshots in tests/vendor_api/ (torch_npu from its PyPI wheel, torch_musa from its
GitHub source, both read statically; torch.xpu and torch.cuda, which is what a ROCm build
exposes, from torch). Regenerate them with `python -m tests.vendor_api.extract`.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fakes import make_device_module
from tests.vendor_api import check, extract
from torchhal.plugins.npu import NpuPlatform

REPO = Path(__file__).parent.parent
PLATFORMS = sorted(check.SNAPSHOTS)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_plugin_and_fake_use_only_real_vendor_names(platform: str) -> None:
    problems = check.report(platform)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_scan_sees_the_calls_the_mapping_tests_exercise(platform: str) -> None:
    """A scanner that found nothing would pass the check above vacuously."""
    plugin = check.builtin_plugins()[platform]
    device = f"torch.{plugin.device_type}"
    uses = {(u.path, u.args, u.keywords) for u in check.plugin_uses(plugin)}
    graph = f"{device}.{plugin.graph_class_name}"
    for expected in [
        (f"{device}.mem_get_info", 1, ()),
        (f"{device}.empty_cache", 0, ()),
        (f"{device}.get_device_properties", 1, ()),
        (f"{device}.stream", 1, ()),
        (f"{device}.Stream", 0, ("device",)),
        (f"{graph}.capture_begin", 0, ("pool",)),
        (f"{graph}.capture_end", 0, ()),
        (f"{device}.device_count", 0, ()),
        (f"{device}.get_device_properties().total_memory", None, ()),
    ]:
        assert expected in uses, f"{expected} not found among {sorted(u[0] for u in uses)}"
    if plugin.ipc_open_method:
        assert (f"torch.UntypedStorage.{plugin.ipc_open_method}", 8, ()) in uses


def test_snapshots_record_what_was_read() -> None:
    for name in {*check.SNAPSHOTS.values(), check.TORCH_SNAPSHOT}:
        snapshot = check.load(name)
        assert name == f"{snapshot['package']}-{snapshot['version']}.json"
        assert snapshot["source"] and snapshot["read"] and snapshot["surfaces"]
    # The statically read packages bind torch.<device> to the module the snapshot describes.
    assert "torch_npu.npu" in check.load(check.SNAPSHOTS["npu"])["bindings"]["torch.npu"]
    assert "sys.modules[__name__]" in check.load(check.SNAPSHOTS["musa"])["bindings"]["torch.musa"]


def test_readme_matrix_names_the_checked_versions() -> None:
    readme = (REPO / "README.md").read_text()
    for platform, name in check.SNAPSHOTS.items():
        snapshot = check.load(name)
        assert f"{snapshot['package']} {snapshot['version']}" in readme, platform


# -- the checker catches what it is for -------------------------------------------------


@pytest.mark.parametrize("platform", ["npu", "musa", "xpu"])
def test_a_planted_fake_name_is_reported(platform: str) -> None:
    plugin = check.builtin_plugins()[platform]
    fake = make_device_module(plugin.device_type, graph_class=plugin.graph_class_name)
    fake.memory_stats_v2 = lambda index: {}  # type: ignore[attr-defined]
    getattr(fake, plugin.graph_class_name).capture_begin_async = lambda self: None
    device = f"torch.{plugin.device_type}"
    problems = check.check_fake(check.fake_names(fake, device), check.snapshots_for(platform))
    assert problems == [
        f"the fake defines {device}.{plugin.graph_class_name}.capture_begin_async, which does not exist in "
        f"{device} in {check.load(check.SNAPSHOTS[platform])['package']} "
        f"{check.load(check.SNAPSHOTS[platform])['version']}",
        f"the fake defines {device}.memory_stats_v2, which does not exist in {device} in "
        f"{check.load(check.SNAPSHOTS[platform])['package']} {check.load(check.SNAPSHOTS[platform])['version']}",
    ]


class _WrongNames(NpuPlatform):
    graph_class_name = "NPUGraphs"  # a typo: every capture_begin / capture_end on it fails
    ipc_open_method = "_new_shared_npu_"

    def allocator_bytes(self, index: int) -> tuple[int, int]:
        module = self.device_module()
        return module.memory_reserved_bytes(index), module.memory_allocated(index)


class _WrongSignatures(NpuPlatform):
    def allocator_bytes(self, index: int) -> tuple[int, int]:
        module = self.device_module()
        return module.memory_reserved(index, abbreviated=True), module.memory_allocated(index, 0)

    def empty_cache(self, index: int) -> int | None:
        self.device_module().empty_cache(index)  # torch_npu's empty_cache() takes no device
        return None


def _problems(plugin: type) -> list[str]:
    uses = check.plugin_uses(plugin)
    return [p for use in uses if (p := check.check_use(use, check.snapshots_for("npu")))]


def test_planted_wrong_names_in_a_plugin_are_reported() -> None:
    problems = "\n".join(_problems(_WrongNames))
    for name in ("NPUGraphs.capture_begin", "NPUGraphs.capture_end", "_new_shared_npu_ ", "memory_reserved_bytes"):
        assert f"{name.strip()} (" in problems, problems
    assert "memory_allocated" not in problems  # a real name stays quiet
    # getattr(module, "NPUGraphs", None) itself is tolerated: the plugin handles its absence.
    assert "torch.npu.NPUGraphs (" not in problems


def test_planted_wrong_signatures_in_a_plugin_are_reported() -> None:
    problems = _problems(_WrongSignatures)
    joined = "\n".join(problems)
    assert len(problems) == 3, joined
    assert "torch.npu.memory_reserved(1 positional, keywords ['abbreviated'])" in joined
    assert "torch.npu.memory_allocated(2 positional" in joined and "real: (device)" in joined
    assert "torch.npu.empty_cache(1 positional" in joined


# -- the static reader that produced the torch_npu / torch_musa snapshots ------------------


def test_static_reader_resolves_reexports_aliases_and_decorators(tmp_path: Path) -> None:
    files = {
        "vend/__init__.py": """
            from .core.memory import *
            from .graphs import Graph as VendGraph, pool_handle
            from . import streams
            from vend._C import _native_fn
            OutOfMemoryError = RuntimeError
            try:
                from .version import __version__
            except ImportError:
                pass
        """,
        "vend/core/__init__.py": "",
        "vend/core/memory.py": """
            __all__ = ["mem_get_info", "memory_reserved"]
            def mem_get_info(device=None): ...
            def memory_reserved(device=None, *, flat=False): ...
            def _private(): ...
            def not_exported(): ...
        """,
        "vend/graphs.py": """
            class Graph(vend._C._Graph):
                def capture_begin(self, pool=None, capture_error_mode="global"): ...
            def pool_handle(): ...
        """,
        "vend/streams.py": "",
        "vend/storage.py": """
            import torch
            @classmethod
            def _new_shared(cls, *args, **kwargs): ...
            def setup():
                torch.UntypedStorage._new_shared_vend = _new_shared
                setattr(torch.UntypedStorage, "_share_vend_", _new_shared)
        """,
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    read, found = extract.reader_for(tmp_path)
    package = extract.StaticPackage(read, "vend")
    names: dict[str, Any] = package.namespace("vend")
    assert sorted(names) == [
        "OutOfMemoryError",
        "VendGraph",
        "__version__",
        "_native_fn",
        "mem_get_info",
        "memory_reserved",
        "pool_handle",
        "streams",
    ]
    assert names["memory_reserved"]["params"] == [
        ["device", "POSITIONAL_OR_KEYWORD", True],
        ["flat", "KEYWORD_ONLY", True],
    ]
    assert names["VendGraph"]["methods"]["capture_begin"][1] == ["pool", "POSITIONAL_OR_KEYWORD", True]
    assert names["_native_fn"] == {"kind": "external", "from": "vend._C"}
    assert names["streams"]["kind"] == "module" and names["__version__"]["kind"] == "unresolved"
    storage = package.storage_methods(found)
    assert sorted(storage) == ["_new_shared_vend", "_share_vend_"]
    assert storage["_new_shared_vend"]["decorators"] == ["classmethod"]
    snapshot = {"package": "vend", "version": "1", "surfaces": {"torch.UntypedStorage": storage}}
    # A classmethod called on the class binds cls: eight arguments go to *args.
    use = check.Use("torch.UntypedStorage._new_shared_vend", 8, (), False, False, "here")
    assert check.check_use(use, [snapshot]) is None


# -- torch.xpu and torch.cuda: the snapshot is the installed torch ------------------------


def test_torch_snapshot_matches_the_installed_torch() -> None:
    snapshot = check.load(check.TORCH_SNAPSHOT)
    if torch.__version__.split("+")[0] != snapshot["version"]:
        pytest.skip(f"snapshot is torch {snapshot['version']}; installed {torch.__version__}")
    live = json.loads(json.dumps(extract.extract_torch()))
    for platform in ("xpu", "rocm"):
        plugin = check.builtin_plugins()[platform]
        used = {use.path for use in check.plugin_uses(plugin)}
        fake = check.fake_for(platform)
        used |= set(check.fake_names(fake, f"torch.{plugin.device_type}")) if fake else set()
        for path in sorted(used):
            assert check.lookup(path, [live]) == check.lookup(path, [snapshot]), path


def test_xpu_has_no_ipc_and_no_oom_class_in_this_torch() -> None:
    """What the xpu plugin and its fake assume about torch.xpu, checked live."""
    assert not any(re.fullmatch(r"_share_xpu_|_new_shared_xpu", n) for n in dir(torch.UntypedStorage))
    assert not hasattr(torch.xpu, "OutOfMemoryError")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_device_modules_have_is_initialized(platform: str) -> None:
    """The conformance suite reads `device_module().is_initialized` to prove detection is lazy."""
    device = f"torch.{check.builtin_plugins()[platform].device_type}"
    entry, where = check.lookup(f"{device}.is_initialized", check.snapshots_for(platform))
    assert entry is not None and entry["kind"] == "function", where


# -- attention backends: the vendor ops they call, and their fakes ---------------------------

FIA = "torch_npu.npu_fused_infer_attention_score"


def test_the_scan_sees_the_npu_attention_call_with_every_keyword() -> None:
    calls = [u for u in check.uses_of("npu") if u.path == FIA]
    assert len(calls) == 1, calls
    assert calls[0].args == 3 and set(calls[0].keywords) == {
        "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv", "block_table", "num_heads", "scale",
        "input_layout", "num_key_value_heads", "sparse_mode", "block_size",
    }
    entry, where = check.lookup(FIA, check.snapshots_for("npu"))
    assert entry is not None and "npu_native_functions_by_codegen.yaml" in entry["defined_in"], where


def test_a_wrong_keyword_or_op_name_in_the_npu_backend_is_reported() -> None:
    from torchhal.plugins.npu_attention import NpuFusedAttention

    class _Misspelt(NpuFusedAttention):
        def _attend(self, query, k_cache, v_cache, meta, query_lens, scale, sliding_window, soft_cap):  # type: ignore[no-untyped-def]
            torch_npu = object()
            torch_npu.npu_fused_infer_attention_score(query, k_cache, v_cache, actual_seq_lengths_kvs=[1])  # type: ignore[attr-defined]
            return torch_npu.npu_fused_infer_attention(query, k_cache, v_cache)  # type: ignore[attr-defined]

    uses = check.plugin_uses(NpuPlatform, (_Misspelt,))
    problems = "\n".join(p for use in uses if (p := check.check_use(use, check.snapshots_for("npu"))))
    assert "got an unexpected keyword argument 'actual_seq_lengths_kvs'" in problems, problems
    assert "torch_npu.npu_fused_infer_attention (" in problems and "does not exist" in problems
    assert "torch.where" not in problems  # plain torch in a backend is not a vendor use


def test_the_fake_npu_op_takes_exactly_the_real_parameters() -> None:
    (path, fake), = check.fake_ops_for("npu").items()
    assert check.check_fake_op(path, fake, check.snapshots_for("npu")) is None

    def dropped_one(query, key, value, *, atten_mask=None):  # type: ignore[no-untyped-def]
        ...

    problem = check.check_fake_op(path, dropped_one, check.snapshots_for("npu"))
    assert problem is not None and "the real one" in problem and "block_table" in problem
    assert "does not exist" in str(check.check_fake_op("torch_npu.npu_fia", dropped_one, check.snapshots_for("npu")))


def test_op_schemas_are_read_as_the_static_reader_writes_parameters() -> None:
    params = extract.schema_params('f(Tensor q, Tensor? k=None, *, SymInt[]? lens=None, str layout="BSH") -> Tensor')
    assert params == [["q", "POSITIONAL_OR_KEYWORD", False], ["k", "POSITIONAL_OR_KEYWORD", True],
                      ["lens", "KEYWORD_ONLY", True], ["layout", "KEYWORD_ONLY", True]]


def test_npu_ops_need_both_a_schema_and_the_binding_torch_npu_makes(tmp_path: Path) -> None:
    (tmp_path / "torch_npu/csrc/aten").mkdir(parents=True)
    (tmp_path / "torch_npu/utils").mkdir(parents=True)
    (tmp_path / extract.NPU_OP_SCHEMAS).write_text(
        "- func: npu_op.out(Tensor q, *, Tensor(a!) out) -> Tensor(a!)\n"
        "- func: npu_op(Tensor q, *, int n=1) -> Tensor\n"
        "- func: npu_unbound(Tensor q) -> Tensor\n")
    (tmp_path / extract.NPU_OP_BINDINGS).write_text("torch_npu.npu_op = torch.ops.npu.npu_op\n")
    read, _ = extract.reader_for(tmp_path)
    assert extract.npu_ops(read, ("npu_op",))["npu_op"]["params"] == [
        ["q", "POSITIONAL_OR_KEYWORD", False], ["n", "KEYWORD_ONLY", True]]  # not the .out overload
    for missing in ("npu_unbound", "npu_absent"):
        with pytest.raises(SystemExit, match=missing):
            extract.npu_ops(read, (missing,))
