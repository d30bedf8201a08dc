"""The vocabulary of the Llama-family decoder: its shape and numerics (`ModelConfig`) and
Llama 3.1 rotary scaling. The decoder, the KV cache and the checkpoint loader speak it."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from torchhal.values import MAX_SIZE, as_index, short_repr


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency-dependent rotary scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        # Out of these ranges the smoothing divides by zero or the frequencies grow: NaN or garbage.
        check_number(self, "factor", self.factor, minimum=1.0, rule="a finite number >= 1")
        check_number(self, "low_freq_factor", self.low_freq_factor, above=0.0, rule="a finite number > 0")
        check_number(self, "high_freq_factor", self.high_freq_factor, above=self.low_freq_factor,
                     rule=f"a finite number > low_freq_factor ({self.low_freq_factor})")
        check_int(self, "original_max_position")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):  # an int beyond float32 breaks torch's pow
            object.__setattr__(self, name, float(getattr(self, name)))


class ConfigValueError(ValueError):
    """A model config value out of its range; `field` names the dataclass field, `rule` what it must be."""

    def __init__(self, owner: object, field: str, value: object, rule: str) -> None:
        self.field, self.value, self.rule = field, value, rule
        super().__init__(f"{type(owner).__name__}.{field} = {short_repr(value)} must be {rule}")


def check_int(owner: object, field: str, minimum: int = 1, maximum: int | None = MAX_SIZE,
              rule: str | None = None) -> None:
    """The frozen `owner`'s `field` kept as a plain int: any integer but a bool (numpy's, an
    IntEnum) in [minimum, maximum] (None: no maximum), else ConfigValueError saying `rule`
    (default: the range)."""
    value = getattr(owner, field)
    number = as_index(value)
    if number is None or number < minimum or (maximum is not None and number > maximum):
        raise ConfigValueError(owner, field, value, rule or f"an int in [{minimum}, {maximum}]")
    object.__setattr__(owner, field, number)


def check_number(
    owner: object, field: str, value: object, rule: str,
    minimum: float | None = None, above: float | None = None, below: float | None = None,
    maximum: float | None = None,
) -> None:
    """`value` a finite real number (not a bool; numpy's too) within the given bounds."""
    number = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)  # type: ignore[arg-type]
        except OverflowError:  # an int beyond any float
            pass
    if not (math.isfinite(number) and (minimum is None or number >= minimum) and (above is None or number > above)
            and (below is None or number < below) and (maximum is None or number <= maximum)):
        raise ConfigValueError(owner, field, value, rule)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    `num_kv_heads` 0 means one KV head per query head (no GQA); `head_dim` 0 means
    `hidden_size // num_heads`. `attention_bias` puts biases on q/k/v (Qwen2),
    `o_proj_bias` on the output projection; `qk_norm` adds per-head RMSNorms on q and k
    (Qwen3); `sliding_window` limits every layer's attention to the last N positions (Mistral).
    `seed` only matters for the seeded reference weights.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 344
    max_position: int = 4096
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    seed: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    rope_scaling: Llama3RopeScaling | None = None
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position"):
            check_int(self, name)
        check_int(self, "num_kv_heads", minimum=0)
        check_int(self, "head_dim", minimum=0)
        check_int(self, "seed", 0, 2**64 - 1, "an int in [0, 2**64)")  # what torch.manual_seed takes
        # rope_theta < 1 makes frequencies above 1 that overflow; eps outside (0, 1) zeroes or NaNs the norms.
        check_number(self, "rope_theta", self.rope_theta, minimum=1.0, rule="a finite number >= 1")
        check_number(self, "rms_eps", self.rms_eps, above=0.0, below=1.0, rule="a finite number in (0, 1)")
        object.__setattr__(self, "rope_theta", float(self.rope_theta))  # an int beyond float32 breaks torch's pow
        object.__setattr__(self, "rms_eps", float(self.rms_eps))
        for name in ("attention_bias", "o_proj_bias", "qk_norm", "tie_word_embeddings"):
            if type(getattr(self, name)) is not bool:
                raise ConfigValueError(self, name, getattr(self, name), "True or False")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ConfigValueError(self, "rope_scaling", self.rope_scaling, "a Llama3RopeScaling or None")
        if self.sliding_window is not None:
            check_int(self, "sliding_window")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                    "give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim = {self.head_dim} must be a positive even int (rotary pairs)")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:  # num_kv_heads >= 1 here: 0 became num_heads
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads} (GQA groups)"
            )
