"""The transport and platform IPC under hostile input: a message is untrusted data from
another process. One test (at least) per class of attack (native-reaching fields, trusted
sizes, element indexing, followed symlinks, leaked files, stray error types)."""

import base64
import dataclasses
import gc
import json
import multiprocessing as mp
import os
import struct
import subprocess
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import torchhal
from torchhal.core.transport import Consumer, Producer, TensorMessage, TransportConfig, TransportError, pool_size
from torchhal.platforms import IpcHandleError

from . import transport_workers
from .transport_workers import fields, forge, forge_handle_record

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[1]
SHM = "/dev/shm"


def small(**overrides):
    return TransportConfig(**{"budget_bytes": 0, "pool_floor_bytes": 1 * MiB, **overrides})


def b64(raw: bytes) -> dict:
    return {"b64": base64.b64encode(raw).decode()}


def map_count() -> int:
    return len(Path("/proc/self/maps").read_text().splitlines())


def cpu_open(handle):
    return torchhal.get_platform("cpu").ipc_support.open(handle, 0)


def run_isolated(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter: a native crash shows as a negative return code."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


# -- native crash: every field that reaches a native call is validated first ----------------

@pytest.mark.parametrize(
    "manager",
    [b"/tmp/torchhal-no-such.sock", b"", b"/" + b"a" * 400, b"relative.sock", b"/tmp/\x00x", "/tmp/é".encode()],
)
def test_cpu_open_never_hands_an_unchecked_manager_socket_to_native_code(manager):
    code = f"""
import dataclasses, torch, torchhal
from torchhal.platforms import IpcHandleError
support = torchhal.get_platform("cpu").ipc_support
tensor = torch.arange(16.0)
handle = support.share(tensor)
bad = dataclasses.replace(handle, storage=({manager!r}, handle.storage[1]))
try:
    support.open(bad, 0)
    print("ACCEPTED")
except IpcHandleError as exc:
    print("IpcHandleError", exc)
except Exception as exc:
    print("WRONG", type(exc).__name__, exc)
"""
    result = run_isolated(code)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.startswith("IpcHandleError") and "manager" in result.stdout, result.stdout


def test_cpu_open_refuses_a_symlink_to_a_real_manager_socket(tmp_path):
    support = torchhal.get_platform("cpu").ipc_support
    tensor = torch.arange(16.0)
    handle = support.share(tensor)
    manager = handle.storage[0]
    link_dir = Path(f"/tmp/torch-shm-dir-{uuid.uuid4().hex[:6]}")
    link_dir.mkdir()
    try:
        (link_dir / "manager.sock").symlink_to(manager.decode())
        bad = dataclasses.replace(handle, storage=(str(link_dir / "manager.sock").encode(), handle.storage[1]))
        with pytest.raises(IpcHandleError, match="symlink|manager socket"):
            support.open(bad, 0)
    finally:
        (link_dir / "manager.sock").unlink()
        link_dir.rmdir()


def test_device_open_validates_native_fields_before_the_driver_call(monkeypatch):
    from .test_vendor_mapping import MusaPlatform, fake_device_tensor, install_extension, make_device_module

    install_extension(monkeypatch, "torch_musa", "musa", make_device_module("musa", graph_class="MUSAGraph"))
    opened = []
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_musa", staticmethod(lambda *a: opened.append(a)),
                        raising=False)
    plugin = MusaPlatform()
    handle = plugin.ipc_share(fake_device_tensor("musa", "_share_musa_"))
    fields = handle.storage
    for storage, match in [
        ((*fields[:3], b"/etc/passwd", *fields[4:]), "ref-counter"),  # a file the open would map and write
        ((*fields[:3], b"/torch_1_2_3", *fields[4:]), "ref-counter"),  # a torch name, but not a real file
        ((*fields[:4], 10**6, *fields[5:]), "ref-counter"),  # a cell past the file
        ((fields[0], b"", *fields[2:]), "not a handle"),
        ((fields[0], b"\x01" * 100_000, *fields[2:]), "not a handle"),
        ((*fields[:2], -5, *fields[3:]), "offset"),
    ]:
        with pytest.raises(IpcHandleError, match=match):
            plugin.ipc_open(dataclasses.replace(handle, storage=storage), 0)
    assert opened == []


def test_device_open_reports_a_driver_refusal_as_an_ipc_handle_error(monkeypatch):
    from .test_vendor_mapping import MusaPlatform, fake_device_tensor, install_extension, make_device_module

    install_extension(monkeypatch, "torch_musa", "musa", make_device_module("musa", graph_class="MUSAGraph"))

    def refuse(*args):
        raise RuntimeError("invalid device pointer")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_musa", staticmethod(refuse), raising=False)
    plugin = MusaPlatform()
    handle = plugin.ipc_share(fake_device_tensor("musa", "_share_musa_"))
    with pytest.raises(IpcHandleError, match="invalid device pointer") as info:
        plugin.ipc_open(handle, 0)
    assert isinstance(info.value.__cause__, RuntimeError)


# -- resource growth: sizes are checked against the real object; opened pools are bounded ----

def test_a_handle_claiming_more_than_the_object_neither_maps_nor_grows_it():
    support = torchhal.get_platform("cpu").ipc_support
    tensor = torch.zeros(MiB, dtype=torch.uint8)
    handle = support.share(tensor)
    path = SHM + handle.storage[1].decode()
    before = os.lstat(path).st_size
    with pytest.raises(IpcHandleError, match="claims a storage of"):
        cpu_open(dataclasses.replace(handle, storage_nbytes=64 * MiB))
    assert os.lstat(path).st_size == before


def test_a_message_claiming_a_bigger_pool_does_not_grow_shared_memory():
    producer, consumer = Producer(small()), Consumer(0)
    message = json.loads(json.dumps(producer.send(torch.arange(16.0))))
    path = SHM + base64.b64decode(json.loads(producer.control.handle_record())["storage"][1]["b64"]).decode()
    before = os.lstat(path).st_size
    forge_handle_record(producer, lambda data: data.update(storage_nbytes=64 * MiB))
    with pytest.raises(TransportError):
        consumer.receive(message)
    assert os.lstat(path).st_size == before
    producer.close()
    consumer.close()


def test_fresh_pool_ids_do_not_open_fresh_mappings():
    producer, consumer = Producer(small()), Consumer(0)
    good = producer.send(torch.arange(16.0))
    consumer.receive(good)
    start = map_count()
    for _ in range(300):
        message = forge(good, pool_id=f"{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            consumer.receive(message)
        except TransportError:
            pass
    assert map_count() - start <= 16
    producer.close()
    consumer.close()


def test_open_producers_are_bounded_and_dropped_when_they_close():
    producers = [Producer(small()) for _ in range(4)]
    consumer = Consumer(0, max_producers=2)
    for _ in range(2):
        for index, producer in enumerate(producers):
            assert consumer.receive(producer.send(torch.full((8,), float(index)))).tolist() == [index] * 8
            assert consumer.open_producers <= 2
    last = producers[0].send(torch.ones(2))
    for producer in producers[:3]:
        producer.close()
    with pytest.raises(TransportError, match="closed|gone"):
        consumer.receive(last)
    survivor = producers[3].send(torch.ones(3))
    assert consumer.receive(survivor).tolist() == [1.0] * 3
    producers[3].close()
    consumer.close()
    with pytest.raises(ValueError, match="max_producers = 0"):
        Consumer(0, max_producers=0)


# -- reading outside the named bytes: the pool is indexed in bytes, always ---------------------

def test_a_non_byte_pool_handle_cannot_read_past_the_named_slice():
    producer, consumer = Producer(small(alignment=512)), Consumer(0)
    messages = [producer.send(torch.full((128,), float(i))) for i in range(6)]  # 512 bytes each, back to back
    target = json.loads(json.dumps(messages[1]))  # slice [512, 1024)
    forge_handle_record(producer, lambda handle: handle.update(dtype="float32", shape=[handle["storage_nbytes"] // 4]))
    try:
        tensor = consumer.receive(target)
    except TransportError:
        tensor = None
    if tensor is not None:  # accepted: it must hold exactly the bytes the message names
        assert tensor.tolist() == [1.0] * 128
    producer.close()
    consumer.close()


def test_a_broadcast_view_cannot_make_the_consumer_allocate_more_than_was_sent():
    producer, consumer = Producer(small()), Consumer(0)
    message = forge(producer.send(torch.arange(4.0)), shape=[1 << 30], stride=[0])
    with pytest.raises(TransportError, match="larger than the 16 bytes"):
        consumer.receive(message)
    producer.close()
    consumer.close()


# -- filesystem: no-follow, this user's regular files, only the sender's names ------------------

def _fake_control(path: Path, pid: int) -> bytes:
    """A file shaped like a control block: alive, pid, 1 slot, 1 consumer, no pool, no events,
    generation 0, no ack yet, no event handle."""
    cells = [1, pid, 1, 1, 0, 0, 0, 0, 0, 0, 0] + [0, -1, 0]
    data = struct.pack(f"{len(cells)}q", *cells)
    path.write_bytes(data)
    return data


def test_a_symlinked_control_block_is_refused_and_not_written(tmp_path):
    producer, consumer = Producer(small()), Consumer(0)
    good = producer.send(torch.arange(16.0))
    target = tmp_path / "victim"
    original = _fake_control(target, os.getpid())
    token = uuid.uuid4().hex[:12]
    link = Path(SHM) / f"torchhal-{os.getpid()}-{token}-ctl"
    link.symlink_to(target)
    try:
        forged = forge(good, pool_id=f"{os.getpid()}-{token}", slot=0, generation=0)  # names the link
        with pytest.raises(TransportError):
            consumer.receive(forged)
        assert target.read_bytes() == original
    finally:
        link.unlink()
    producer.close()
    consumer.close()


def test_a_fifo_named_like_a_host_block_does_not_hang_the_consumer():
    producer, consumer = Producer(small()), Consumer(0)
    good = producer.send(torch.arange(16.0))
    name = f"torchhal-{fields(good)['pool_id']}-h{fields(good)['slot']}-g{fields(good)['generation']}"
    os.mkfifo(os.path.join(SHM, name), 0o600)
    try:
        with pytest.raises(TransportError, match="regular file"):
            consumer.receive(forge(good, kind="host"))  # its host block is the FIFO
    finally:
        os.unlink(os.path.join(SHM, name))
    producer.close()
    consumer.close()


def test_a_message_may_only_name_its_own_producers_files():
    """A message names files only through its producer id: the control block and host blocks
    are derived from it (never sent), and of the pid it names."""
    sender, other = Producer(small()), Producer(small())
    consumer = Consumer(0)
    theirs = other.send(torch.arange(4.0))
    acks_before = bytes(other.control.shm.map)
    ours = sender.send(torch.arange(4.0))
    token = fields(theirs)["pool_id"].split("-")[1]
    for forged, match in (
        (forge(ours, pool_id=fields(theirs)["pool_id"], generation=fields(theirs)["generation"] + 1), "stale"),
        (forge(theirs, pool_id=f"1-{token}"), "is gone"),  # their token under another pid: no such file
        (forge(ours, kind="host"), "is gone"),  # a host block the sender never made
        (forge(ours, pool_id=f"{os.getpid()}-{token}0"), "not a producer id"),
    ):
        with pytest.raises(TransportError, match=match):
            consumer.receive(forged)
    assert bytes(other.control.shm.map) == acks_before  # nothing acknowledged on the other's behalf
    sender.close()
    other.close()
    consumer.close()


# -- leaks after a crash: files of dead producers are reclaimed --------------------------------

def _crashed_producer_files() -> list[str]:
    ctx = mp.get_context("spawn")
    outbox, release = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=transport_workers.produce_then_exit, args=(outbox, release, True))
    proc.start()
    message = outbox.get(timeout=120)
    release.set()
    deadline = time.monotonic() + 60
    while proc.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.05)
    decoded = TensorMessage.from_wire(message)
    files = [name for name in os.listdir(SHM) if name.startswith(f"torchhal-{decoded.producer_pid}-")]
    assert decoded.control in files and len(files) >= 2  # control block and a host block were left
    return files


def test_the_next_producer_reclaims_files_of_a_crashed_one():
    files = _crashed_producer_files()
    producer = Producer(small())
    assert not set(files) & set(os.listdir(SHM))
    producer.close()


def test_the_reclaim_command_removes_files_of_a_crashed_one(tmp_path):
    # The crashed producer's own file names, recreated in a private directory: in /dev/shm any
    # other producer on the machine (a second test suite) may reclaim them first.
    files = _crashed_producer_files()
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    live, foreign = f"torchhal-{os.getpid()}-{uuid.uuid4().hex[:12]}", "someone-elses-file"
    (tmp_path / live).write_bytes(b"x")
    (tmp_path / foreign).write_bytes(b"x")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "torchhal.core.transport", "reclaim", "--dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path)) == sorted([live, foreign])
    assert all(f"removed {name}" in result.stdout for name in files)


@pytest.mark.parametrize("where", ["missing", "a file"])
def test_the_reclaim_command_refuses_a_directory_that_is_not_one(tmp_path, capsys, where):
    # A report of "0 file(s) ... removed" would make a mistyped --dir look like a clean machine.
    from torchhal.core.transport.__main__ import main

    target = tmp_path / "shm"
    if where == "a file":
        target.write_bytes(b"x")
    with pytest.raises(SystemExit) as ended:
        main(["reclaim", "--dir", str(target)])
    assert ended.value.code == 2
    assert f"--dir {target}" in capsys.readouterr().err
    assert main(["reclaim", "--dir", str(tmp_path)]) == 0


def test_reclaim_keeps_live_producers_and_foreign_files():
    producer = Producer(small())
    from torchhal.core.transport import reclaim_orphans

    reclaim_orphans()
    assert producer.control.name in os.listdir(SHM)  # alive: kept
    producer.close()


# -- one error type -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "storage",
    [
        [b64(b"/tmp/x"), b64(b"/torch_1_2_3")],  # a vanished object: IpcHandleError inside
        [b64(b"/tmp/x"), b64("/torch_é".encode())],
        ["a", "b"],
        [1, 2],
    ],
)
def test_receive_raises_only_transport_errors_with_the_cause_chained(storage):
    producer, consumer = Producer(small()), Consumer(0)
    message = json.loads(json.dumps(producer.send(torch.arange(16.0))))
    forge_handle_record(producer, lambda data: data.update(storage=storage))
    with pytest.raises(TransportError):
        consumer.receive(message)
    producer.close()
    consumer.close()


def test_a_garbled_handle_record_is_refused_and_the_consumer_recovers():
    """The pool handle is read from the control block once, checked against its fingerprint."""
    producer, consumer = Producer(small()), Consumer(0)
    message = producer.send(torch.arange(16.0))
    start = producer.control._handle_start
    raw = producer.control._raw
    original = raw[start]
    raw[start] = ord("[")  # one byte of the record changed
    with pytest.raises(TransportError, match="does not match its fingerprint"):
        consumer.receive(message)
    raw[start] = original
    assert consumer.receive(message).tolist() == list(range(16))  # nothing was cached from the garbled one
    producer.close()
    consumer.close()


def test_a_forged_handle_record_that_is_not_a_flat_byte_pool_is_refused():
    producer, consumer = Producer(small()), Consumer(0)
    message = producer.send(torch.arange(16.0))
    forge_handle_record(producer, lambda data: data.update(offset_bytes=512))
    with pytest.raises(TransportError, match="flat uint8 buffer"):
        consumer.receive(message)
    producer.close()
    consumer.close()


def test_a_control_block_of_inconsistent_layout_is_refused():
    producer, consumer = Producer(small()), Consumer(0)
    message = producer.send(torch.arange(16.0))
    producer.control.cells[10] += 8  # the handle record's length does not match the file
    with pytest.raises(TransportError, match="inconsistent layout"):
        consumer.receive(message)
    producer.control.cells[10] -= 8
    assert consumer.receive(message).tolist() == list(range(16))
    producer.close()
    consumer.close()


def test_a_control_block_layout_rewritten_after_opening_is_not_believed():
    """The layout is read once, when the consumer opens the block and checks it against the
    file's size: a later rewrite of those cells cannot move the cells it reads or writes."""
    producer, consumer = Producer(small()), Consumer(0)
    assert consumer.receive(producer.send(torch.arange(16.0))).tolist() == list(range(16))
    producer.reclaim()
    cells = producer.control.cells
    saved = [cells[i] for i in (2, 3, 4, 9, 10)]
    cells[2], cells[3], cells[4], cells[9], cells[10] = 1 << 40, 0, 1, 1 << 20, 1 << 30
    message = producer.send(torch.arange(16.0) + 1)
    assert consumer.receive(message).tolist() == list(range(1, 17))
    assert producer.reclaim() == 1  # the ack landed in the message's own cell
    for i, value in zip((2, 3, 4, 9, 10), saved, strict=True):
        cells[i] = value
    producer.close()
    consumer.close()


def test_platform_open_failure_inside_receive_is_a_transport_error_with_cause(monkeypatch):
    producer, consumer = Producer(small()), Consumer(0)
    message = producer.send(torch.arange(16.0))
    support = torchhal.get_platform("cpu").ipc_support

    def failing_open(handle, device):
        raise IpcHandleError("shared memory vanished")

    platform = consumer.platform
    monkeypatch.setattr(type(platform), "ipc_support",
                        property(lambda self: dataclasses.replace(support, open=failing_open)))
    with pytest.raises(TransportError, match="vanished") as info:
        consumer.receive(message)
    assert isinstance(info.value.__cause__, IpcHandleError)
    producer.close()
    consumer.close()


# -- the budget and the workers split -----------------------------------------------------------

def test_default_budget_is_one_gib_for_one_worker():
    config = TransportConfig()
    assert (config.budget_bytes, config.workers, config.pool_floor_bytes) == (1 << 30, 1, 128 * MiB)
    assert pool_size(config.budget_bytes, config.workers, config.pool_floor_bytes) == 1 << 30


def test_producer_pool_is_its_share_of_the_budget():
    producer = Producer(TransportConfig(budget_bytes=8 * MiB, workers=4, pool_floor_bytes=MiB))
    assert producer.pool_bytes == 2 * MiB and producer.pool is not None and producer.pool.numel() == 2 * MiB
    assert producer.pool_handle is not None and producer.pool_handle.shape == (2 * MiB,)
    with pytest.warns(UserWarning, match=r"Raise TransportConfig.budget_bytes \(now 8 MiB for 4 worker\(s\)\)"):
        producer.send(torch.zeros(3 * MiB, dtype=torch.uint8))  # over the share: host fallback names the knob
    producer.close()
    floor = Producer(TransportConfig(budget_bytes=8 * MiB, workers=16, pool_floor_bytes=MiB))
    assert floor.pool_bytes == MiB  # 512 KiB share raised to the floor
    floor.close()


# -- the fuzz test: bounded, seeded, in a subprocess so a crash is caught ----------------------

def test_fuzzed_receive_and_open_against_real_pools():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "fuzz_transport.py"), "--cases", "20000", "--seed", "13"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, (result.returncode, result.stdout[-3000:], result.stderr[-3000:])
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["cases"] == 20000
    assert summary["accepted"] > 100 and summary["rejected"] > 1000 and summary["open_accepted"] > 10
    assert summary["shm_growth_bytes"] <= summary["shm_bound"] and summary["maps_growth"] <= summary["maps_bound"]


def test_ref_counter_names_are_torch_names_not_the_drivers_ipc_files():
    # torch's CUDA ref-counter files come from the same name generator as a CPU filename
    # storage; the /dev/shm/cuda.shm.* files the driver makes for IPC events are not ref-counters.
    from torchhal.plugins.accelerator import _check_refcount_file

    counter = torch.zeros(10_000, dtype=torch.int64)
    torch_name = bytes(counter.untyped_storage()._share_filename_cpu_()[1])
    _check_refcount_file(torch_name, 9_999)  # a real torch name of a live file: accepted
    driver_file = f"cuda.shm.{os.geteuid()}.{os.getpid():x}.1"
    with open(f"/dev/shm/{driver_file}", "wb") as f:
        f.truncate(8 * 10_000)
    try:
        for name in (f"/{driver_file}".encode(), driver_file.encode(), torch_name + b"/../" + driver_file.encode()):
            with pytest.raises(IpcHandleError, match="not a torch ref-counter"):
                _check_refcount_file(name, 0)
    finally:
        os.unlink(f"/dev/shm/{driver_file}")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("alignment", -512, r"TransportConfig.alignment = -512 must be an int >= 16"),
    ("alignment", 0, r"TransportConfig.alignment = 0 must be an int >= 16"),
    ("alignment", 24, r"TransportConfig.alignment = 24 must be a multiple of 16 bytes"),
    ("consumers", 0, r"TransportConfig.consumers = 0 must be an int >= 1"),
    ("max_slices", 0, r"TransportConfig.max_slices = 0 must be an int >= 1"),
    ("workers", True, r"TransportConfig.workers = True must be an int >= 1"),
    ("budget_bytes", "1G", r"TransportConfig.budget_bytes = '1G' must be an int >= 0"),
    ("interprocess_events", "no", r"TransportConfig.interprocess_events = 'no' must be True or False"),
    # every consumer's open refused the control block such a producer made as "inconsistent"
    ("max_slices", 1 << 23, r"TransportConfig.max_slices = 8388608 with consumers = 1 needs 25165824 control "
                            r"cells, at most 16777215: lower max_slices or consumers"),
])
def test_a_bad_transport_config_is_refused_when_it_is_made(field, value, message):
    with pytest.raises(TypeError if field == "interprocess_events" else ValueError, match=message):
        small(**{field: value})


def test_bad_input_to_the_ends_is_refused_without_taking_anything():
    producer = Producer(small())
    slots, free = len(producer._free_slots), producer.free_bytes
    for bad in ([1.0, 2.0], None):
        with pytest.raises(TypeError, match="send\\(\\) takes a torch.Tensor, got a"):
            producer.send(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="send\\(\\) takes a strided \\(dense\\) tensor, got layout torch.sparse_coo"):
        producer.send(torch.eye(3).to_sparse())
    for _ in range(producer.config.max_slices + 1):  # each took a slice and kept it
        with pytest.raises(ValueError, match="send\\(\\) got a tensor on the meta device \\(\\(8,\\) torch.float32\\)"):
            producer.send(torch.empty(8, device="meta"))
    assert (len(producer._free_slots), producer.free_bytes) == (slots, free)
    message = producer.send(torch.ones(3))
    producer.close()
    producer.close()  # a second close does nothing
    assert producer.reclaim() == 0  # raised a released memoryview's ValueError
    with pytest.raises(RuntimeError, match="this Producer is closed"):
        producer.send(torch.ones(3))
    for keyword, value, text in (("rank", -1, "rank = -1 must be an int >= 0"),
                                 ("rank", "1", "rank = '1' must be an int >= 0"),
                                 ("max_producers", "3", "max_producers = '3' must be an int >= 1"),
                                 ("device_index", 7, "device_index = 7, but platform 'cpu' has 1 device"),
                                 ("copy_stream", "yes", "copy_stream = 'yes' must be True or False")):
        with pytest.raises(TypeError if keyword == "copy_stream" else ValueError, match=text):
            Consumer(**{keyword: value})
    consumer = Consumer()
    consumer.close()
    with pytest.raises(RuntimeError, match="this Consumer is closed"):
        consumer.receive(message)
    assert consumer.open_producers == 0  # nothing was reopened


@pytest.mark.parametrize("path", ["pool", "host"])
def test_a_send_whose_copy_fails_gives_back_its_slice_bytes_and_host_file(monkeypatch, path):
    # Kept taken, the slice, its pool bytes and a host block's file (which close() would not
    # unlink) would refuse every send after max_slices such failures.
    producer = Producer(small(max_slices=2))
    slots, free = len(producer._free_slots), producer.free_bytes
    numel = 8 if path == "pool" else 2 * MiB // 4  # over the 1 MiB pool: host memory

    def failing(*args, **kwargs):
        raise RuntimeError("copy failed")

    with monkeypatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the host path's "pool full" warning
        patch.setattr(producer, "_slice", failing)
        patch.setattr(torch, "frombuffer", failing)
        for _ in range(3):
            with pytest.raises(RuntimeError, match="copy failed"):
                producer.send(torch.ones(numel))
    assert (len(producer._free_slots), producer.free_bytes) == (slots, free)
    assert not [name for name in os.listdir("/dev/shm") if producer.pool_id in name and not name.endswith("-ctl")]
    consumer = Consumer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        message = producer.send(torch.full((numel,), 2.0))
    assert torch.equal(consumer.receive(message), torch.full((numel,), 2.0))
    consumer.close()
    producer.close()


def test_a_message_replayed_after_its_slice_was_reclaimed_is_stale():
    # A's bytes go to another slot's message once reclaimed; replayed, A must not read B's data.
    producer, consumer = Producer(small()), Consumer()
    a = producer.send(torch.full((3,), 1.0))
    c = producer.send(torch.full((3,), 2.0))
    consumer.receive(a), consumer.receive(c)
    assert producer.reclaim() == 2
    b = producer.send(torch.full((3,), 9.0))
    assert fields(b)["offset"] == fields(a)["offset"] and fields(b)["slot"] != fields(a)["slot"]
    with pytest.raises(TransportError, match=f"stale message: slice {fields(a)['slot']} was recycled"):
        consumer.receive(a)
    assert consumer.receive(b).tolist() == [9.0, 9.0, 9.0]
    consumer.close()
    producer.close()


def test_a_host_message_names_its_block_from_the_first_byte():
    producer = Producer(small())
    with pytest.warns(UserWarning, match="sending through host shared memory"):
        message = producer.send(torch.arange(2 * MiB // 4, dtype=torch.float32))  # over the 1 MiB pool
    assert fields(message)["kind"] == "host" and fields(message)["offset"] == 0
    consumer = Consumer()
    for offset in (8, 10**9):
        with pytest.raises(TransportError, match=f"'offset' = {offset} must be 0 in a host message"):
            consumer.receive(forge(message, offset=offset))
    assert consumer.receive(message)[:3].tolist() == [0.0, 1.0, 2.0]
    consumer.close()
    producer.close()


# -- arguments of the public calls: refused by name, with the fix, before anything is made ------

@pytest.mark.parametrize("make", [Producer, Consumer])
def test_a_platform_that_is_not_one_is_refused_by_name(make):
    # Unchecked: AttributeError "'str' object has no attribute 'current_device'".
    keyword = {"config": small()} if make is Producer else {}
    with pytest.raises(TypeError, match=rf"{make.__name__}: platform = 'cpu' must be a torchhal Platform "
                                        r"\(torchhal.get_platform\(name\) gives one\)"):
        make(platform="cpu", **keyword)


@pytest.mark.parametrize("flag", [None, "no", 0, 1])
def test_receive_and_flush_acks_take_only_true_or_false(flag):
    # Read as truthy or falsy, copy=None would hand out a zero-copy view of the producer's
    # slice, valid only until the producer recycles it, and copy="no" would copy.
    producer, consumer = Producer(small()), Consumer()
    message = producer.send(torch.ones(3))
    with pytest.raises(TypeError, match=rf"^receive\(copy\) = {flag!r} must be True or False$"):
        consumer.receive(message, copy=flag)
    with pytest.raises(TypeError, match=rf"^flush_acks\(wait\) = {flag!r} must be True or False$"):
        consumer.flush_acks(wait=flag)
    assert consumer.open_producers == 0  # the refused receive opened nothing
    assert consumer.receive(message).tolist() == [1.0, 1.0, 1.0]  # and acknowledged nothing: still fresh
    consumer.close()
    producer.close()


@pytest.mark.parametrize(("budget", "workers", "message"), [
    (True, 1, r"budget_bytes = True must be an int >= 0"),
    (1.5e9, 2, r"budget_bytes = 1500000000.0 must be an int >= 0"),
    (1 << 30, 0.5, r"workers = 0.5 must be an int >= 1"),
    ("1G", 1, r"budget_bytes = '1G' must be an int >= 0"),
    (1 << 30, 0, r"workers = 0 must be an int >= 1"),
])
def test_pool_size_refuses_what_transport_config_refuses(budget, workers, message):
    # Unchecked, pool_size(1.5e9, 2) returns a float pool size, True counts as one byte, and
    # "1G" is a bare TypeError from the comparison.
    with pytest.raises(ValueError, match=message):
        pool_size(budget, workers)


# -- the producer's files: never left behind by a live process ----------------------------------

def producer_files(pool_id: str) -> list[str]:
    return sorted(name for name in os.listdir(SHM) if name.startswith(f"torchhal-{pool_id}-"))


def test_a_producer_dropped_without_close_unlinks_its_files():
    # Its control block and host blocks must not stay in /dev/shm while the process lives
    # (reclaim skips a live pid): a server making producers without close() would fill it.
    producer = Producer(small())
    with pytest.warns(UserWarning, match="sending through host shared memory"):
        producer.send(torch.zeros(2 * MiB // 4))  # over the 1 MiB pool: a host block
    pool_id = producer.pool_id
    assert producer_files(pool_id) == [f"torchhal-{pool_id}-ctl", f"torchhal-{pool_id}-h0-g1"]
    del producer
    gc.collect()
    assert producer_files(pool_id) == []


def test_a_forked_child_exiting_leaves_its_parents_producer_files_alone():
    # The finalizer that unlinks a dropped producer's files is inherited by a forked child,
    # whose exit (its atexit handlers, or the copy's collection) must not run it on the parent's files.
    producer = Producer(small())
    pool_id = producer.pool_id
    child = os.fork()
    if child == 0:  # the child: drop its copy, then exit as a normal exit does
        try:
            import atexit

            del producer
            gc.collect()
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    assert producer_files(pool_id) == [f"torchhal-{pool_id}-ctl"]
    producer.close()
    assert producer_files(pool_id) == []


def test_a_producer_whose_construction_is_interrupted_leaves_no_file(monkeypatch):
    # Ctrl-C (or any error) after the control block is made must not leave it in /dev/shm.
    from torchhal.core.transport import producer as producer_module

    pool_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    monkeypatch.setattr(producer_module, "new_pool_id", lambda: pool_id)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    platform = torchhal.current_platform()
    monkeypatch.setattr(platform, "new_event", interrupted)
    with pytest.raises(KeyboardInterrupt):
        Producer(small(), platform=platform)
    assert producer_files(pool_id) == []


def test_close_waits_for_a_send_running_in_another_thread():
    # close() takes the producer's lock: a send in flight on another thread that went on after
    # close would make its host block after close unlinked the others (it would stay in
    # /dev/shm), and a pool send would meet the released control block.
    producer = Producer(small())
    inside, go_on = threading.Event(), threading.Event()
    to_host = producer._to_host

    def slow_to_host(*args):
        inside.set()
        go_on.wait(10)
        return to_host(*args)

    producer._to_host = slow_to_host  # type: ignore[method-assign]
    outcome: list[object] = []

    def send() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the host path's "pool full" warning
            outcome.append(producer.send(torch.zeros(2 * MiB // 4)))

    sender = threading.Thread(target=send)
    sender.start()
    assert inside.wait(10)
    closer = threading.Thread(target=producer.close)
    closer.start()
    closer.join(0.3)
    waited = closer.is_alive()  # close must wait for the send that holds a slot
    go_on.set()
    sender.join(10)
    closer.join(10)
    assert waited and len(outcome) == 1  # the send finished before close took its files
    assert producer_files(producer.pool_id) == []
    with pytest.raises(RuntimeError, match="this Producer is closed"):
        producer.send(torch.ones(3))


@pytest.mark.parametrize(("shape", "message"), [
    ([1] * 33, r"send\(\) got a tensor of 33 dimensions; a message carries at most 32: reshape it first"),
    ([0, 2**49], r"send\(\) got a tensor of shape \(0, 562949953421312\): dimension 1 is over the 2\*\*48 - 1 "
                 r"a message carries; reshape it first"),
])
def test_a_tensor_no_consumer_would_accept_is_refused_at_send_without_taking_a_slice(shape, message):
    # Sent, every consumer would refuse the message, and its slice, never acknowledged, would
    # stay taken for the producer's life (max_slices such sends refusing every later one).
    producer = Producer(small())
    slots, free = len(producer._free_slots), producer.free_bytes
    with pytest.raises(ValueError, match=message):
        producer.send(torch.empty(shape))
    assert (len(producer._free_slots), producer.free_bytes) == (slots, free)
    producer.close()
