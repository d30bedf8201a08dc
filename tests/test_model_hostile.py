"""The model vocabulary under hostile input: a tensor-parallel plan of something that is no
model config is refused naming a way to one that exists."""

from __future__ import annotations

import pytest


def test_the_plans_type_error_names_a_way_to_a_config_that_exists():
    from torchhal.core.model.parallel import TensorParallelPlan

    with pytest.raises(TypeError) as refused:
        TensorParallelPlan({"num_attention_heads": 4}, 2)  # type: ignore[arg-type]
    assert "ModelConfig.from_hf" not in str(refused.value)  # there is no such method
    assert "config_from_hf" in str(refused.value)
    from torchhal.core.model.checkpoint import config_from_hf  # the one it names

    assert callable(config_from_hf)
