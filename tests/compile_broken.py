"""Platforms asking for inductor options, on the CPU, for the compile clause's own tests
(tests/test_compile_conformance.py registers this module as a plugin).

- `compile_correct` asks for a launch setting that changes no number (the CUDA plugin's own,
  which CPU code generation leaves alone): the clause must pass it;
- `compile_changes_numbers` asks for `emulate_precision_casts`, which rounds intermediates the
  way eager code does: faithful, but other bits than inductor's default, so not result-neutral;
- `compile_unknown_option` asks for an option inductor does not have (a typo, or another torch
  version's name).
"""

from __future__ import annotations

from torchhal.platforms import CompileSupport, hookimpl
from torchhal.plugins.cpu import CpuPlatform


def platform_with(name: str, options: dict[str, bool | int | str]) -> CpuPlatform:
    support = CompileSupport(inductor_options=options, note=name.replace("_", " "))

    def compile_support(self: CpuPlatform) -> CompileSupport:
        return support

    cls = type(f"Compile{name.title().replace('_', '')}", (CpuPlatform,),
               {"name": name, "priority": -1, "compile_support": compile_support})
    return cls()


@hookimpl
def torchhal_register_platforms() -> list[CpuPlatform]:
    return [
        platform_with("compile_correct", {"triton.enable_pdl": True}),
        platform_with("compile_changes_numbers", {"emulate_precision_casts": True}),
        platform_with("compile_unknown_option", {"triton.enable_pld": True}),
    ]
