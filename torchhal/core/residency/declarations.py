"""What a pipeline declares: the strategy names, its stages and the component uses in them."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from torchhal.values import check_bool


class Strategy(str, enum.Enum):
    """Names of the built-in strategies (a placement may also be a ResidencyStrategy instance)."""

    RESIDENT = "resident"
    OFFLOAD = "offload"
    LAYERWISE = "layerwise"


_FLAGS = ("memory_intensive", "allow_prefetch", "keep_ready_after_warmup", "preferred_ready_after_request")


@dataclass(frozen=True)
class ComponentUse:
    """One use of a component, in the order the pipeline runs them."""

    component: str
    #: a label told apart from other uses of the same component (e.g. "step3"); checked by begin_use
    phase: str | None = None
    #: the release after this use is a release point (empties the cache)
    memory_intensive: bool = False
    allow_prefetch: bool = True
    keep_ready_after_warmup: bool = False
    preferred_ready_after_request: bool = False
    #: dtype of the component's device weights during this use (None: as registered)
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.component, str) or not self.component:
            raise ValueError(f"ComponentUse.component must be a component name (str), got {self.component!r}")
        if self.phase is not None and not isinstance(self.phase, str):
            raise ValueError(f"ComponentUse.phase must be a str or None, got {self.phase!r}")
        for flag in _FLAGS:
            check_bool(f"ComponentUse({self.component!r}).{flag}", getattr(self, flag))
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise ValueError(f"the use of {self.component!r} declares dtype {self.dtype!r}; a target dtype is a "
                             "floating torch.dtype such as torch.bfloat16")


@dataclass(frozen=True)
class Stage:
    """A pipeline stage (e.g. encode, denoise, decode): a name and the uses it makes, in order.

    `exact=False` makes the uses a forecast rather than a contract: the stage's components may
    then be used any number of times (none included) in any order, until a use of a later stage
    begins; prefetching still follows the order listed. For a stage whose count the caller
    cannot know beforehand: a denoiser run once per step of whatever schedule the scheduler
    makes, text encoders run a second time for a negative prompt."""

    name: str
    uses: tuple[ComponentUse, ...]
    exact: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Stage name must be a non-empty str such as 'denoise', got {self.name!r}")
        check_bool(f"stage {self.name!r}: exact", self.exact)
        if isinstance(self.uses, (ComponentUse, str, bytes)) or not isinstance(self.uses, Iterable):
            got = (f"the single use of {self.uses.component!r}; pass uses=(use,)" if isinstance(self.uses, ComponentUse)
                   else f"{self.uses!r}; pass e.g. uses=(ComponentUse('unet'),)")
            raise ValueError(f"stage {self.name!r}: uses must be a tuple of ComponentUse records, got {got}")
        uses = tuple(self.uses)
        if not uses:  # e.g. a comprehension over a component list that came out empty
            raise ValueError(f"stage {self.name!r} has no uses; a stage declares the component uses it makes: pass "
                             "at least one ComponentUse, or leave the stage out")
        bad = [u for u in uses if not isinstance(u, ComponentUse)]
        if bad:
            raise ValueError(f"stage {self.name!r}: uses must be ComponentUse records, got {bad[0]!r}")
        object.__setattr__(self, "uses", uses)


class RequestFailed(RuntimeError):
    """A request ended by an error at the request boundary; the manager stays consistent."""


class UndeclaredUse(RuntimeError):
    """begin_use of a use that is not one the request's stages allow next (out of order, or
    after the declared uses ran out): the pipeline runs otherwise than its stages say."""

    def __init__(self, message: str, component: str | None = None, expected: str | None = None,
                 allowed: tuple[str, ...] | None = None) -> None:
        super().__init__(message)
        #: the component whose use began, and the first one allowed next (None: the uses ran out)
        self.component, self.expected = component, expected
        #: every component the stages allowed next, in their order
        self.allowed = allowed if allowed is not None else (() if expected is None else (expected,))
