"""Tensor-parallel ranks for tests/test_tensor_parallel.py (spawned, so importable at top level).

Each rank joins a gloo group through `torchhal.distributed.init_group`, runs the jobs it is
given (the same jobs in the same order on every rank: SPMD) and puts plain data on the queue.
"""

from __future__ import annotations

import contextlib
import traceback
from datetime import timedelta
from typing import Any

import torch

MAX_BATCH_TOKENS = 8  # small: prompts are prefilled in several chunks
DECODE_GRAPHS = dict(batch_buckets=(1, 2, 4), context_buckets=(32, 64), steps_per_sync=4, emulate=True)


def engine_config(emulate: bool) -> Any:
    from torchhal.core.engine.records import DecodeGraphConfig, EngineConfig

    graphs = DecodeGraphConfig(**DECODE_GRAPHS) if emulate else None  # type: ignore[arg-type]
    return EngineConfig(dtype=torch.float32, max_batch_tokens=MAX_BATCH_TOKENS, kv_block_size=4,
                        max_kv_slots=512, decode_graphs=graphs)


def model_engine_config(job: dict[str, Any], emulate: bool) -> Any:
    """`engine_config(emulate)` serving the seeded reference model `job["model"]` describes."""
    import dataclasses

    from torchhal.core.model import ModelConfig

    return dataclasses.replace(engine_config(emulate), model=ModelConfig(**job["model"]))


def run_rank(rank: int, world: int, store_path: str, jobs: list[dict[str, Any]], queue: Any,
             timeout_s: float = 60.0) -> None:
    try:
        import torch.distributed as dist

        from torchhal.distributed import init_group

        torch.set_num_threads(1)  # several ranks share a 2-core machine
        group = init_group(rank=rank, world_size=world, local_rank=rank, store=dist.FileStore(store_path, world),
                           timeout=timedelta(seconds=timeout_s))
        results = {job["name"]: JOBS[job["kind"]](group, job) for job in jobs}
        queue.put(("ok", (rank, results)))
    except BaseException:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}"))


def generate(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Tokens from a checkpoint on the eager path (chunked prefill) and with emulated full-graph decode."""
    from torchhal.core.engine import GenerationEngine

    out: dict[str, Any] = {}
    for emulate in (False, True):
        engine = GenerationEngine.from_checkpoint(job["path"], engine_config(emulate), group=group)
        results = engine.generate(job["prompts"], job["new_tokens"])
        out["graphs" if emulate else "eager"] = [list(r.output) for r in results]
        if emulate:
            runner = engine.decode_runner
            out["emulated_steps"] = runner.steps if runner is not None else 0
        out["num_blocks"] = engine.kv_sizing.num_blocks
    # The logits every rank sees are the whole vocabulary's, no padding column.
    hidden = torch.ones(2, engine.model_config.hidden_size)
    out["logits_width"] = engine.model.logits(hidden, torch.tensor([0, 1])).shape[-1]
    return out


def reference(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """The engine's own reference model (no checkpoint), sharded by the engine."""
    from torchhal.core.engine import GenerationEngine

    config = model_engine_config(job, emulate=False)
    engine = GenerationEngine(config, group=group)
    return {"tokens": [list(r.output) for r in engine.generate(job["prompts"], job["new_tokens"])]}


def lifecycle(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Weight update from whole HF tensors, pause(retract)/continue mid-generation, sleep/wake."""
    import dataclasses

    from torchhal.core.engine import GenerationEngine
    from torchhal.core.model.checkpoint import iter_checkpoint_tensors
    from torchhal.platforms.testing import patched_plugin

    # Rank r sees (r + 1) MiB free: every rank must size its KV pool from the least of them.
    platform = group.platform
    free = dataclasses.replace(platform.memory_info(0), free=(group.rank + 1) << 20)
    with patched_plugin(platform, memory_info=lambda index: free):
        engine = GenerationEngine.from_checkpoint(
            job["path"], dataclasses.replace(engine_config(False), max_kv_slots=1 << 16), group=group)
    prompts, new = job["prompts"], job["new_tokens"]
    sizing = engine.kv_sizing
    out: dict[str, Any] = {"num_blocks": sizing.num_blocks, "bytes_per_block": sizing.bytes_per_block}
    # A rank's shard shape is not an HF shape: refused, nothing applied.
    name, param = next((n, p) for n, p in engine.model.named_parameters() if n.endswith("q_proj.weight"))
    try:
        engine.update_weights_from_tensors({name: torch.zeros_like(param)})
        out["shard_shaped_update"] = "accepted"
    except ValueError as exc:
        out["shard_shaped_update"] = str(exc)
    out["version_after_refusal"] = engine.weight_version

    # pause(retract) in the middle of a generation, then continue: the same tokens.
    rids = [engine.add_request(p, new) for p in prompts]
    for _ in range(3):
        engine.step()
    engine.pause_generation("retract")
    engine.continue_generation()
    while engine.pending():
        engine.step()
    out["paused"] = [list(engine.results.pop(rid).output) for rid in rids]

    engine.release_memory_occupation()
    engine.resume_memory_occupation()
    out["woken"] = [list(r.output) for r in engine.generate(prompts, new)]

    engine.update_weights_from_tensors(iter_checkpoint_tensors(job["update_path"]))
    out["updated"] = [list(r.output) for r in engine.generate(prompts, new)]
    return out


def tied_update(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Updates of a tied model over a padded vocabulary: the embedding alone (whole HF tensor,
    under the embedding's name and then under lm_head's, one weight), then a whole checkpoint."""
    from torchhal.core.engine import GenerationEngine
    from torchhal.core.model.checkpoint import iter_checkpoint_tensors

    engine = GenerationEngine.from_checkpoint(job["path"], engine_config(False), group=group)
    prompts, new = job["prompts"], job["new_tokens"]
    embedding = dict(iter_checkpoint_tensors(job["update_path"]))["model.embed_tokens.weight"]
    out: dict[str, Any] = {}
    engine.update_weights_from_tensors({"model.embed_tokens.weight": embedding})
    out["embedding"] = [list(r.output) for r in engine.generate(prompts, new)]
    engine.update_weights_from_tensors({"lm_head.weight": embedding * 2})
    out["lm_head"] = [list(r.output) for r in engine.generate(prompts, new)]
    engine.update_weights_from_tensors(iter_checkpoint_tensors(job["update_path"]))
    out["whole"] = [list(r.output) for r in engine.generate(prompts, new)]
    return out


def failure(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """A step that fails on one rank only, in the model or (`cut="admission"`) in its bookkeeping
    (an admission whose plan is cut short, so that rank's book is recovered): every rank's
    engine must refuse to go on."""
    from torchhal.core.engine import GenerationEngine

    engine = GenerationEngine.from_checkpoint(job["path"], engine_config(False), group=group)
    if group.rank == job["failing_rank"] and job.get("cut") == "admission":
        admit = engine.requests.admit_next

        def admit_then_fail(tokens: int) -> Any:
            admit(tokens)
            raise RuntimeError("injected failure on this rank, after an admission")

        engine.requests.admit_next = admit_then_fail  # type: ignore[method-assign]
    elif group.rank == job["failing_rank"]:
        def fail(*args: Any) -> torch.Tensor:
            raise RuntimeError("injected failure on this rank")

        engine.runner.forward = fail  # type: ignore[method-assign]
    out: dict[str, Any] = {}
    try:
        engine.generate(job["prompts"], 2)
        out["step"] = "returned"
    except Exception as exc:
        out["step"] = type(exc).__name__
    try:
        engine.generate(job["prompts"], 2)
        out["after"] = "returned"
    except RuntimeError as exc:
        out["after"] = str(exc)
    out["pending"] = engine.pending()
    return out


def disagreement(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Ranks that disagree: a weight batch one rank refuses (a NaN only in its slice), a norm
    given other values on one rank, engine calls with other arguments on one rank, configs
    that differ, then a closed group: every rank must refuse alike, nothing applied or read."""
    import dataclasses

    from torchhal.core.engine import GenerationEngine
    from torchhal.core.model import checkpoint
    from torchhal.core.model.checkpoint import iter_checkpoint_tensors

    config = dataclasses.replace(engine_config(False), check_finite_weights=True)
    engine = GenerationEngine.from_checkpoint(job["path"], config, group=group)
    prompts, new = job["prompts"], job["new_tokens"]
    out: dict[str, Any] = {"before": [list(r.output) for r in engine.generate(prompts, new)]}
    name = job["weight"]
    poisoned = dict(iter_checkpoint_tensors(job["path"]))[name] * -3
    poisoned[tuple(job["nan_at"])] = float("nan")  # a column only the last rank holds
    try:
        engine.update_weights_from_tensors({name: poisoned})
        out["update"] = "applied"
    except ValueError as exc:
        out["update"] = str(exc)
    out["version"] = engine.weight_version
    out["after"] = [list(r.output) for r in engine.generate(prompts, new)]

    # A replicated weight (a norm, held whole by every rank) given other values on rank 1.
    norm = dict(iter_checkpoint_tensors(job["path"]))["model.norm.weight"] * (1.0 + group.rank)
    try:
        engine.update_weights_from_tensors({"model.norm.weight": norm})
        out["replicated"] = "applied"
    except ValueError as exc:
        out["replicated"] = str(exc)
    out["replicated_version"] = engine.weight_version
    # Calls that differ between ranks: refused on every rank before a step, nothing queued.
    for call, run in (("generate", lambda: engine.generate([prompts[0][: 2 + group.rank]], new)),
                      ("add_request", lambda: engine.add_request(prompts[0], new + group.rank))):
        try:
            run()
            out[call] = "ran"
        except ValueError as exc:
            out[call] = str(exc)
    out["pending_after_calls"] = engine.pending()
    out["after_calls"] = [list(r.output) for r in engine.generate(prompts, new)]

    differing = dataclasses.replace(config, max_kv_slots=256 if group.rank == 0 else 512)
    try:
        GenerationEngine.from_checkpoint(job["path"], differing, group=group)
        out["config"] = "built"
    except ValueError as exc:
        out["config"] = str(exc)

    reads: list[str] = []
    real_load = checkpoint.load_checkpoint
    checkpoint.load_checkpoint = lambda *args, **kwargs: reads.append("read") or real_load(*args, **kwargs)
    group.close()
    try:
        GenerationEngine.from_checkpoint(job["path"], config, group=group)
        out["closed"] = "built"
    except RuntimeError as exc:
        out["closed"] = f"{type(exc).__name__}: {exc}"
    finally:
        checkpoint.load_checkpoint = real_load
    out["reads_after_close"] = len(reads)
    return out


def wrong_shard(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Every rank given rank 0's shard (a copied rank number): every rank refuses at once, in
    the same collective, and the group still serves the right shards afterwards."""
    import time

    from torchhal.core.engine import GenerationEngine
    from torchhal.core.model.checkpoint import load_checkpoint

    shard, _ = load_checkpoint(job["path"], tensor_parallel=(group.world_size, 0))
    start = time.monotonic()
    try:
        GenerationEngine(engine_config(False), model=shard, group=group)
        refused = "built"
    except ValueError as exc:
        refused = str(exc)
    seconds = time.monotonic() - start
    own, _ = load_checkpoint(job["path"], tensor_parallel=(group.world_size, group.rank))
    engine = GenerationEngine(engine_config(False), model=own, group=group)
    return {"refused": refused, "seconds": seconds,
            "tokens": [list(r.output) for r in engine.generate(job["prompts"], job["new_tokens"])]}


def close_group(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """`group.close()` with an engine (emulated decode graphs) still alive, and one already gone."""
    import gc
    import weakref

    from torchhal.core.engine import GenerationEngine

    config = model_engine_config(job, emulate=True)
    gone = GenerationEngine(config, group=group)
    gone_ref = weakref.ref(gone)
    del gone
    gc.collect()  # the engine's own reference cycles; the group must not be what keeps it
    engine = GenerationEngine(config, group=group)
    before = [list(r.output) for r in engine.generate(job["prompts"], 4)]
    runner = engine.decode_runner
    assert runner is not None
    release = runner.release
    seen: dict[str, Any] = {}

    def spied_release() -> None:
        # The group still works here: its graphs go before its backends do.
        seen["sum_while_releasing"] = group.comm.all_reduce(torch.ones(1)).item()
        release()

    runner.release = spied_release  # type: ignore[method-assign]
    group.close()
    runner.release = release  # type: ignore[method-assign]
    try:
        engine.generate(job["prompts"], 2)
        after = "returned"
    except RuntimeError as exc:
        after = str(exc)
    engine.release_memory_occupation()  # sleep still frees the device
    try:
        engine.resume_memory_occupation()  # wake would recapture graphs on a closed group
        wake = "woke"
    except RuntimeError as exc:
        wake = str(exc)
    return {"collected": gone_ref() is None, "tokens": before, **seen, "after": after, "wake": wake}


class StalledEvent:
    """Device work that never finishes (a collective replayed from a graph, its peer gone)."""

    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("an unbounded wait on device work that never finishes")


def stalled_device(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's device work stops finishing mid-run, under collectives declared capturable (as
    NCCL's: they join the graphs, where no backend times them out)."""
    import time

    from torchhal.core.engine import GenerationEngine
    from torchhal.platforms.testing import patched_plugin

    group.comm.graph_capturable = True
    config = model_engine_config(job, emulate=True)
    engine = GenerationEngine(config, group=group)
    engine.generate(job["prompts"], 2)
    started = time.monotonic()
    stall = patched_plugin(group.platform, new_event=StalledEvent) if group.rank == 0 else contextlib.nullcontext()
    with stall:
        try:
            engine.generate(job["prompts"], 4)
            after = "returned"
        except Exception as exc:
            after = f"{type(exc).__name__}: {exc}"
    return {"after": after, "seconds": time.monotonic() - started, "broken": engine.broken}


def lonely_refusal(group: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One rank alone cannot build its engine: first its checkpoint directory is missing (refused
    before the ranks agree), then its load fails after they agreed. Every rank refuses each
    time (its peers naming it, not timing out in a collective), and the group still serves."""
    from torchhal.core.engine import GenerationEngine
    from torchhal.core.model import checkpoint

    def attempt(path: str) -> str:
        try:
            GenerationEngine.from_checkpoint(path, engine_config(False), group=group)
            return "built"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"

    out = {"missing": attempt(job["path"] if group.rank == 0 else job["path"] + "-missing")}
    real_load = checkpoint.load_checkpoint

    def damaged(*args: Any, **kwargs: Any) -> Any:
        raise checkpoint.CheckpointError("a shard damaged on this host")

    if group.rank == 1:
        checkpoint.load_checkpoint = damaged
    try:
        out["load"] = attempt(job["path"])
    finally:
        checkpoint.load_checkpoint = real_load
    engine = GenerationEngine.from_checkpoint(job["path"], engine_config(False), group=group)
    out["tokens"] = [list(r.output) for r in engine.generate(job["prompts"], job["new_tokens"])]
    return out


JOBS = {"close": close_group, "lonely_refusal": lonely_refusal, "stalled_device": stalled_device,
        "generate": generate, "lifecycle": lifecycle, "failure": failure, "reference": reference,
        "disagreement": disagreement, "wrong_shard": wrong_shard, "tied_update": tied_update}
