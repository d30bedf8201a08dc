"""Tensor parallel: what every rank's engine must agree on before it acts.

Ranks run the same engine calls (SPMD), but nothing makes their arguments equal: a config
that differs, or a weight update one rank refuses and another applies, would leave the
ranks computing different models and meeting in collectives of different sizes. These
checks make every rank reach the same verdict over the group's host communicator, before
anything is moved, allocated or written.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING

import torch

from torchhal.core.engine.records import EngineConfig

if TYPE_CHECKING:
    from torchhal.core.model import Model
    from torchhal.distributed import DeviceGroup


def check_group(group: object) -> None:
    """`group` is an open `DeviceGroup` (from `init_group`) or None."""
    from torchhal.distributed import CollectiveError, DeviceGroup

    if group is not None and not isinstance(group, DeviceGroup):
        raise TypeError(f"group is a {type(group).__name__}; pass the DeviceGroup from "
                        "torchhal.distributed.init_group(...), or None for one device")
    if group is not None and group.closed:  # checked here: a group of one rank makes no collective that would fail
        raise CollectiveError(f"group {group.name!r} is closed (DeviceGroup.close); make a new group with init_group")


def shard_problem(model: Model | None, group: DeviceGroup | None) -> str | None:
    """Why `model` cannot run as this rank's tensor-parallel shard in `group` (None: it can, or
    it is whole): a shard runs only as its own rank of a group of its size, and every rank's
    model must have the same config (`model_problem`, a collective every rank of a group of
    several makes, problem or not)."""
    disagreement = model_problem(model, group)
    shard = getattr(model, "shard", None)
    if shard is None:
        return disagreement
    ranks = group.world_size if group is not None else 1
    if ranks != shard.world_size:
        return (f"the model is rank {shard.rank} of a {shard.world_size}-way tensor-parallel shard, but the engine's "
                f"group has {ranks} rank(s); pass group=init_group(world_size={shard.world_size}, ...), or a whole "
                "model")
    if group is not None and shard.rank != group.rank:
        return (f"the model is rank {shard.rank}'s tensor-parallel shard, but this engine is rank {group.rank}; load "
                f"this rank's shard (load_checkpoint(..., tensor_parallel=({ranks}, {group.rank})), or "
                "from_checkpoint(..., group=group))")
    return disagreement


def model_digests(model: Model | None) -> torch.Tensor:
    """[1, 2 + ModelConfig's fields]: whether a model was given, its config's class, then one
    digest per ModelConfig field (read by name from any config: one width on every rank)."""
    from torchhal.core.model import ModelConfig

    config = getattr(model, "config", None)
    return _digests([model is not None, type(config).__qualname__,
                     *(getattr(config, field.name, None) for field in dataclasses.fields(ModelConfig))])


def model_problem(model: Model | None, group: DeviceGroup | None) -> str | None:
    """How this rank's model differs from its peers' (None: it does not, or there are no peers).
    Ranks whose models differ in shape (another checkpoint, a layer more, another vocabulary)
    would meet in collectives of other sizes, which gloo answers by aborting the process, or
    compute a model that is neither (another rope_theta) without an error."""
    if group is None or group.world_size == 1:
        return None
    from torchhal.core.model import ModelConfig

    mine = model_digests(model)
    everyone = group.host.all_gather(mine)
    differing = (everyone != mine).any(dim=0).tolist()
    if not any(differing):
        return None
    if differing[0]:
        return ("some ranks passed a model and others none (the engine builds its reference decoder from "
                "EngineConfig.model); every rank must pass the same kind of model")
    config = getattr(model, "config", None)
    if differing[1]:
        return (f"the model's config is a {type(config).__name__} on this rank and another class on other ranks; "
                "every rank must load the same model")
    names = [field.name for field in dataclasses.fields(ModelConfig)]
    shown = _shown_differences(names, [getattr(config, name, None) for name in names], everyone[:, 2:], mine[:, 2:])
    return (f"the model differs between the group's ranks in {shown}; every rank must load the same checkpoint "
            "(or build the same ModelConfig)")


#: Fields each rank sets for itself: the device is the rank's own (`engine_device_index`
#: checks it against the group's placement).
PER_RANK_FIELDS = frozenset({"device"})


def _describe(value: object) -> str:
    """A value's text that is the same in every process: a callable (a compile backend) by its
    name, or its class's (a function's, a partial's or an object's repr holds an address)."""
    if callable(value) and not isinstance(value, type):
        named = value if hasattr(value, "__qualname__") else type(value)
        return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"
    return repr(value)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little")  # fits int64


def _digests(values: list[object]) -> torch.Tensor:
    """[1, len(values)]: one int64 digest of each value, equal in every process."""
    return torch.tensor([[_digest(_describe(value)) for value in values]], dtype=torch.int64)


def _shown_differences(names: list[str], values: list[object], everyone: torch.Tensor, mine: torch.Tensor) -> str:
    """The fields whose digest column differs on some rank, each with this rank's value ("" if none)."""
    differing = (everyone != mine).any(dim=0).tolist()
    return ", ".join(f"{name} (this rank: {_describe(value)})"
                     for name, value, differs in zip(names, values, differing, strict=True) if differs)


def agreed_fields(config: EngineConfig) -> list[str]:
    return [field.name for field in dataclasses.fields(config) if field.name not in PER_RANK_FIELDS]


def config_digests(config: EngineConfig) -> torch.Tensor:
    """[1, fields]: one int64 digest of each agreed field's value, equal in every process."""
    return _digests([getattr(config, name) for name in agreed_fields(config)])


def agree_on_config(config: EngineConfig, group: DeviceGroup | None, problem: str | None = None) -> None:
    """Every rank's `EngineConfig` field by field, and every rank's `problem` (what it found
    wrong with its own arguments, e.g. `shard_problem`): a difference, or a problem on any
    rank, is a ValueError on every rank (one collective on the host communicator; a closed
    group refuses here). A rank raising alone would leave the others waiting in their next
    collective until the group's timeout."""
    if group is None or group.world_size == 1:
        if problem is not None:
            raise ValueError(problem)
        return
    names = agreed_fields(config)
    mine = config_digests(config)
    flagged = torch.tensor([[int(problem is not None)]], dtype=torch.int64)
    everyone = group.host.all_gather(torch.cat([mine, flagged], dim=1))
    if problem is not None:
        raise ValueError(problem)
    refused = [rank for rank, flag in enumerate(everyone[:, -1].tolist()) if flag]
    if refused:
        raise ValueError(f"rank(s) {refused} of the group refused their engine arguments (their error says why); "
                         "every rank refuses alike")
    shown = _shown_differences(names, [getattr(config, name) for name in names], everyone[:, :-1], mine)
    if shown:
        raise ValueError(f"EngineConfig differs between the group's ranks in {shown}; every rank must build its "
                         "engine with the same EngineConfig")


def refuse_with_peers(group: DeviceGroup | None, error: BaseException) -> None:
    """Call before raising `error`, this rank's refusal of its own arguments ahead of
    `agree_on_config`: joins that agreement with a problem flagged, so the peers refuse
    with it at once instead of waiting in it until the group's timeout. Anything the
    collective itself raises (a closed group, a dead peer) gives way to `error`."""
    if group is None or group.world_size == 1 or group.closed:
        return
    try:
        agree_on_config(EngineConfig(), group, f"{type(error).__name__}: {error}")
    except Exception:  # our own problem coming back, or a collective that failed: `error` is the one to raise
        pass


def agree_on_verdict(group: DeviceGroup, refused: bool) -> list[int]:
    """The ranks that refused (an empty list: none did); every rank gets the same list."""
    flags = group.host.all_gather(torch.tensor([int(refused)], dtype=torch.int64))
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def agree_on_update(group: DeviceGroup, refused: bool, replicated: int = 0) -> tuple[list[int], list[int]]:
    """A weight update's verdicts: (the ranks that refused, the ranks whose `replicated` digest
    differs from rank 0's); every rank gets the same lists. `replicated` digests the values a rank
    was given for the weights every rank holds whole (the norms): ranks given different values
    would each serve a model of their own."""
    rows = group.host.all_gather(torch.tensor([[int(refused), replicated]], dtype=torch.int64)).tolist()
    return ([rank for rank, (flag, _) in enumerate(rows) if flag],
            [rank for rank, (_, digest) in enumerate(rows) if digest != rows[0][1]])


def value_digest(named: list[tuple[str, torch.Tensor]]) -> int:
    """One int64 digest of names and values (their bytes), equal in every process given the same."""
    hasher = hashlib.blake2b(digest_size=7)
    for name, value in named:
        hasher.update(name.encode())
        hasher.update(value.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return int.from_bytes(hasher.digest(), "little")


def agree_on_call(group: DeviceGroup | None, broken: str | None, call: str, *arguments: object) -> None:
    """Every rank makes the same engine call with the same arguments (SPMD): ranks whose
    `generate` prompts differed would meet in collectives of other sizes, which gloo answers by
    aborting the process. A difference is a ValueError on every rank, naming the ranks that
    differ from rank 0 (one small collective on the host communicator per call). An engine
    that is `broken` (why) is refused first: its group may be unusable."""
    refuse_broken(broken)
    if group is None:
        return
    mine = _digests([call, *arguments])
    everyone = group.host.all_gather(mine)
    apart = [rank for rank, row in enumerate(everyone.tolist()) if row != everyone[0].tolist()]
    if apart:
        raise ValueError(f"{call}() was called with other arguments on rank(s) {apart} than on rank 0 of the group; "
                         "under tensor parallel every rank makes the same engine calls with the same arguments")


def refuse_broken(broken: str | None) -> None:
    """An engine a failed step or a closed group ended (`broken`: why) runs nothing more."""
    if broken is not None:
        raise RuntimeError(broken)
