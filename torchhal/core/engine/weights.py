"""Weight updates: validate and stage every tensor first, then write; derived weights follow.

Everything that depends on the input (names, shapes, dtypes, layouts, values when
asked, conversion and placement) is checked and prepared before the first write, so a
bad batch leaves the old weights and derived weights untouched. The write phase is
then only same-shape, same-dtype dense copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from torchhal.core.engine.ranks import value_digest
from torchhal.core.engine.records import WeightUpdateIncomplete, WeightUpdateRejected
from torchhal.core.model import Model
from torchhal.core.model.parallel import RankShard
from torchhal.values import short_repr

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class WeightUpdater:
    """`shard`: the model is one tensor-parallel rank's shard; updates still give whole HF
    tensors, checked against the whole shapes, and this rank writes its slice of each."""

    def __init__(self, model: Model, check_finite: bool = False, shard: RankShard | None = None,
                 agree: Callable[[bool, int], tuple[list[int], list[int]]] | None = None) -> None:
        """`agree(failed, replicated)` (tensor parallel, `ranks.agree_on_update`): the ranks whose
        verdict was a failure, and those whose digest of the replicated weights' values differs
        from rank 0's. Asked once before writing, so that a batch one rank refuses (a NaN in its
        slice, other values for a norm) no rank applies, and once after, so that a write that
        fails on one rank leaves every rank refusing generation until the batch is rewritten."""
        self.model = model
        self.check_finite = check_finite
        self.shard = shard
        self.agree = agree
        self.version = 0
        # Weights a failed write may have left half-updated (or a level-2 sleep discarded);
        # generation is refused until an update covering them succeeds (the old values cannot
        # be restored without a model-sized copy, which every update would pay for).
        self.incomplete: set[str] = set()
        self._unset_why: str | None = None

    def apply(self, named_tensors: NamedTensors) -> int:
        """Replace the named weights all together and rebuild derived weights; returns the count."""
        try:
            names, staged, replicated = self._checked_and_staged(named_tensors)
        except BaseException:  # a refusal, anything staging raised, Ctrl-C: the peers must not wait for this rank
            if self.agree is not None:
                self.agree(True, 0)  # the peers refuse with this rank
            raise
        refused_by, apart = self.agree(False, value_digest(replicated)) if self.agree is not None else ([], [])
        if refused_by:
            raise WeightUpdateRejected(
                f"weight update rejected, nothing applied: rank(s) {refused_by} of the group refused it (their error "
                "names why); every rank refuses a batch any rank refuses"
            )
        if apart:
            shown = ", ".join(name for name, _ in replicated[:3]) + (", ..." if len(replicated) > 3 else "")
            raise WeightUpdateRejected(
                f"weight update rejected, nothing applied: rank(s) {apart} of the group were given other values than "
                f"rank 0 for the weights every rank holds whole ({shown or 'none in this batch'}); under tensor "
                "parallel every rank updates with the same tensors"
            )
        written = len(staged)  # a tied weight given under both names is one
        failure: BaseException | None = None
        try:
            with torch.no_grad():
                for param, value in staged:
                    param.copy_(value)
                del staged
                self.model.process_weights()
        except BaseException as exc:
            failure = exc
        # Tensor parallel: a write that failed on any rank leaves the ranks' weights different, so
        # every rank refuses generation until the batch is rewritten (else the peers would step
        # alone and wait out the group's timeout in the first collective).
        failed_on = self.agree(failure is not None, 0)[0] if self.agree is not None else []
        if failure is not None or failed_on:
            self.incomplete.update(names)
            if failure is not None and not isinstance(failure, Exception):  # Ctrl-C stays Ctrl-C
                raise failure
            where = (f"({type(failure).__name__}: {failure})" if failure is not None
                     else f"on rank(s) {failed_on} of the group (their error names why)")
            raise WeightUpdateIncomplete(
                f"writing the validated weights failed part-way {where}; generation is refused until an update of "
                "every weight in this batch succeeds"
            ) from failure
        self.incomplete.difference_update(names)
        self.version += 1
        return written

    def _checked_and_staged(
        self, named_tensors: NamedTensors,
    ) -> tuple[list[str], list[tuple[torch.Tensor, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """Every check, and each value in its parameter's dtype and place: (every name of the
        parameters written, (param, value), (name, value) of the weights every tensor-parallel
        rank holds whole)."""
        items = self._items(named_tensors)
        # Tied weights are one parameter under two names (lm_head.weight and the embedding's).
        params = dict(self.model.named_parameters(remove_duplicate=False))
        problems = self._problems(items, params, self.shard) if items else [
            "the update names no weights (an empty dict or iterable); weight_version is unchanged"]
        if problems:
            raise WeightUpdateRejected("weight update rejected, nothing applied: " + "; ".join(problems))
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        replicated: list[tuple[str, torch.Tensor]] = []
        written = _WrittenFirst()
        staged_params: set[int] = set()
        for name, tensor in items:
            if id(params[name]) in staged_params:
                continue  # a tied weight's second name: `_problems` refused it holding other values
            staged_params.add(id(params[name]))
            try:
                value = self._stage(tensor if self.shard is None else self.shard.take(name, tensor), params[name])
            except Exception as exc:
                raise WeightUpdateRejected(
                    f"weight update rejected, nothing applied: {name!r} cannot be converted to "
                    f"{params[name].dtype} on {params[name].device}: {exc}"
                ) from exc
            if self.check_finite and not bool(torch.isfinite(value).all()):
                raise WeightUpdateRejected(
                    f"weight update rejected, nothing applied: {name!r} holds NaN or infinite values "
                    f"(in {params[name].dtype})"
                )
            if written.overlaps(value):
                value = value.clone()  # its source is a weight this batch writes first (a swap)
            written.add(params[name])
            staged.append((params[name], value))
            if self.shard is not None and self.shard.slice_of(name) is None:
                replicated.append((name, value))
        # Every name of each written parameter: a tied weight written under one name is
        # rewritten under both, so an update naming either clears a failed write's refusal.
        return [name for name, param in params.items() if id(param) in staged_params], staged, replicated

    def mark_unset(self, why: str) -> None:
        """Every weight holds no values now (a level-2 sleep): generation is refused, saying
        `why`, until updates have covered them all."""
        self.incomplete.update(name for name, _ in self.model.named_parameters(remove_duplicate=False))
        self._unset_why = why

    def refusal(self) -> str | None:
        """Why the model must not run (a failed write, or weights a sleep discarded), or None."""
        if not self.incomplete:
            self._unset_why = None
            return None
        if self._unset_why is not None:
            return f"{self._unset_why} ({len(self.incomplete)} weight(s) not yet updated)"
        shown = ", ".join(sorted(self.incomplete)[:5]) + (", ..." if len(self.incomplete) > 5 else "")
        return (
            f"{len(self.incomplete)} weight(s) may be half-written by a failed update ({shown}); "
            "update them again before generating"
        )

    @staticmethod
    def _items(named_tensors: NamedTensors) -> list[tuple[str, torch.Tensor]]:
        if isinstance(named_tensors, Mapping):
            return list(named_tensors.items())
        if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not isinstance(named_tensors, Iterable):
            raise WeightUpdateRejected(
                f"weight update rejected, nothing applied: the update is a {type(named_tensors).__name__}; pass a "
                "dict of name -> tensor or an iterable of (name, tensor) pairs, e.g. model.named_parameters()"
            )
        items = []
        for entry in named_tensors:
            if not isinstance(entry, tuple) or len(entry) != 2:
                raise WeightUpdateRejected(
                    f"weight update rejected, nothing applied: entry {len(items)} {_short(entry)} is not a "
                    "(name, tensor) tuple"
                )
            items.append(entry)
        return items

    @staticmethod
    def _problems(items: list[tuple[str, torch.Tensor]], params: dict[str, torch.nn.Parameter],
                  shard: RankShard | None) -> list[str]:
        problems = []
        seen: set[str] = set()
        first_name: dict[int, tuple[str, torch.Tensor]] = {}  # a parameter's first good name, and its value
        for name, tensor in items:
            if not isinstance(name, str):  # checked first: a list or dict name is not even hashable
                kind = type(name).__name__
                problems.append(f"weight name {name!r} is a {kind}; names are str, e.g. 'lm_head.weight'")
                continue
            if name in seen:
                problems.append(f"{name!r} given twice")
            seen.add(name)
            target = params.get(name)
            if target is None:
                problems.append(f"unknown weight {name!r}")
                continue
            shape = tuple(target.shape) if shard is None else shard.full_shape(name, tuple(target.shape))
            if not isinstance(tensor, torch.Tensor):
                kind = type(tensor).__name__
                problems.append(f"{name!r} is a {kind}, not a torch.Tensor of shape {shape}")
            elif tuple(tensor.shape) != shape:
                problems.append(f"{name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            elif not tensor.dtype.is_floating_point:
                problems.append(f"{name!r} has dtype {tensor.dtype}, expected a floating dtype like {target.dtype}")
            elif tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
                problems.append(f"{name!r} is not a dense tensor (layout {tensor.layout}); pass tensor.to_dense()")
            elif tensor.is_meta:
                problems.append(f"{name!r} is a meta tensor and holds no values")
            else:
                tied_name, tied_value = first_name.setdefault(id(target), (name, tensor))
                if tied_name != name and not _same_values(tensor, tied_value):
                    problems.append(f"{name!r} and {tied_name!r} are one tied weight, given different values; "
                                    "send one")
        return problems

    @staticmethod
    def _stage(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The source in the parameter's dtype, without a device copy of the whole model.

        Host tensors are converted on the host and copied straight into the parameter;
        tensors already on the parameter's device are used as they are (converted there
        only when their dtype differs). Staging every weight on the device first would
        add a model-sized transient to every update.
        """
        if tensor.device == param.device or tensor.device.type == "cpu":
            value = tensor if tensor.dtype == param.dtype else tensor.to(param.dtype)
        else:
            value = tensor.to(param.device, param.dtype)
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            # A tensor subclass copies by its own rules: copy it into a plain tensor now, so that
            # anything it raises happens before the first write (a transient of its size).
            plain = torch.empty(value.shape, dtype=param.dtype, device=value.device)
            plain.copy_(value)
            value = plain
        if value.dtype != param.dtype or value.shape != param.shape or value.layout != torch.strided:
            raise TypeError(f"staged as {value.dtype} {tuple(value.shape)} {value.layout}")
        return value


def _same_values(tensor: torch.Tensor, other: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN: a tied pair holding NaN is still one value)."""
    if tensor is other:
        return True
    return torch.allclose(tensor, other.to(tensor.device, tensor.dtype), rtol=0, atol=0, equal_nan=True)


class _WrittenFirst:
    """The weights a batch writes, in order, by storage: a later source that reads one of them
    (a swap of two weights, views into one fused weight) must be copied before the writes.
    Only targets sharing the source's storage are compared, so a batch costs O(weights)."""

    def __init__(self) -> None:
        self._spans: dict[tuple[torch.device, int], list[tuple[int, int]]] = {}

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple[torch.device, int]:
        return tensor.device, tensor.untyped_storage().data_ptr()

    @staticmethod
    def _span(tensor: torch.Tensor) -> tuple[int, int]:
        extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)) + 1
        return tensor.data_ptr(), tensor.data_ptr() + extent * tensor.element_size()

    def add(self, target: torch.Tensor) -> None:
        if target.numel():
            self._spans.setdefault(self._key(target), []).append(self._span(target))

    def overlaps(self, source: torch.Tensor) -> bool:
        spans = self._spans.get(self._key(source)) if source.numel() else None
        if not spans:
            return False
        start, end = self._span(source)
        return any(start < target_end and target_start < end for target_start, target_end in spans)


def _short(value: object) -> str:
    """A one-line description of an update's entry: tensors by shape and dtype, not by values."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {value.dtype}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_short(v) for v in value[:3]) + (", ..." if len(value) > 3 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return short_repr(value, 60)
