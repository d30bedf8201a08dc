"""Layer programs and the graph runners that replay them."""

from torchhal.core.graphs.decode import DecodeCaptureReport, DecodeGraphRunner, DecodeRow
from torchhal.core.graphs.program import (
    OUTPUT_ROWS,
    BreakStep,
    GraphStep,
    StackState,
    Step,
    copy_into_captured,
    run_eager,
    run_for_rows,
    split_segments,
)
from torchhal.core.graphs.runner import CaptureReport, GraphRunner, ResolvedStack, resolve_layer_stack

__all__ = [
    "OUTPUT_ROWS",
    "BreakStep",
    "CaptureReport",
    "DecodeCaptureReport",
    "DecodeGraphRunner",
    "DecodeRow",
    "GraphRunner",
    "GraphStep",
    "ResolvedStack",
    "StackState",
    "Step",
    "copy_into_captured",
    "resolve_layer_stack",
    "run_eager",
    "run_for_rows",
    "split_segments",
]
