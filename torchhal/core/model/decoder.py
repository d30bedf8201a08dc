"""The Llama-family decoder (Llama, Llama 3, Mistral, Qwen2, Qwen3) over a paged KV cache.

Module and parameter names mirror Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...),
so an HF state dict loads by name and weight updates use HF names. The fused QKV (with its
bias) and gate-up weights are the storage: the HF-named q/k/v and gate/up parameters are row
views into them, so a load or update by name fills the fused weight in place (graph-captured
addresses stay valid) and the fused layout costs no second copy of those weights.
The layer stack is exposed explicitly (`layer_program()`), with attention marked as a
breakable op, for the graph runner; attention reads the paged cache (`kv_cache.KVCache`)
in place through the backend named by each step's `AttentionMetadata`. The model's
vocabulary (`ModelConfig`, the cache, the metadata) lives in `config` and `kv_cache`.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from torchhal.attention import decode_metadata_for_rows
from torchhal.core.graphs.program import (
    OUTPUT_ROWS,
    BreakStep,
    GraphStep,
    StackState,
    Step,
    check_step_inputs,
    run_for_rows,
)
from torchhal.core.model.config import ModelConfig
from torchhal.core.model.kv_cache import AttentionMetadata, KVCache
from torchhal.core.model.linear import LinearFn, routed_linear, takes_kernel
from torchhal.core.model.parallel import RankShard, TensorParallelPlan
from torchhal.values import short_repr

if TYPE_CHECKING:
    from torchhal.distributed import Communicator
    from torchhal.platforms import LinearSupport

#: State key of an output projection not yet added to the residual (see `LayerMath.into_residual`).
PENDING = "pending"

def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies in fp32, as Hugging Face computes them (incl. `llama3` scaling)."""
    dim = config.head_dim
    # On the host even inside a meta-device context (meta arithmetic imports the compiler stack).
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (config.rope_theta ** (steps / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    low_freq_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Linear(nn.Linear):
    """`nn.Linear` without the random init: weights are loaded or set by the caller (and
    drawing random numbers on the meta device is slow: it pulls in the compiler stack)."""

    def reset_parameters(self) -> None:
        return None


class Embedding(nn.Embedding):
    """`nn.Embedding` without the random init (see `Linear`)."""

    def reset_parameters(self) -> None:
        return None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's numbers (x in fp32 times rsqrt of the fp32 mean of squares, cast back, then the
    weight): rms_norm computes in fp32 for 16-bit inputs and rounds once, as HF's cast does,
    in one kernel where the platform fuses it (decode is launch-bound)."""
    return weight * F.rms_norm(x, weight.shape, eps=eps)


class FusedSlice(nn.Module):
    """An HF-named projection (`weight`, optional `bias`) whose tensors are row views into its
    owner's fused weight: loading or updating it by name writes the fused weight directly, so
    the fused layout costs no second copy. The owner converts and re-views it on every move."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FusedSlice:
        return self  # the owner converts the fused storage once and re-views these


class FusedProjections(nn.Module):
    """Row blocks of one fused projection, exposed as HF-named children (`q_proj`, `k_proj`, ...)."""

    def __init__(self, blocks: dict[str, int], in_features: int, bias: bool) -> None:
        super().__init__()
        self.blocks = blocks
        rows = sum(blocks.values())
        self.fused_weight: torch.Tensor
        self.fused_bias: torch.Tensor | None
        self.register_buffer("fused_weight", torch.empty(rows, in_features), persistent=False)
        self.register_buffer("fused_bias", torch.empty(rows) if bias else None, persistent=False)
        self.slices: dict[str, FusedSlice] = {}
        self._view()

    def _view(self) -> None:
        start = 0
        for name, rows in self.blocks.items():
            weight = self.fused_weight[start : start + rows]
            bias = self.fused_bias[start : start + rows] if self.fused_bias is not None else None
            if name in self.slices:  # new parameters: `.data =` cannot cross from meta to a device
                piece = self.slices[name]
                piece.weight = nn.Parameter(weight)
                if bias is not None:
                    piece.bias = nn.Parameter(bias)
            else:
                self.slices[name] = FusedSlice(weight, bias)
                self.add_module(name, self.slices[name])
            start += rows

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> FusedProjections:
        super()._apply(fn, recurse)
        self._view()
        return self


class Attention(FusedProjections):
    """HF-named q/k/v/o projections (+ optional q/k norms); q/k/v are views of the fused QKV."""

    def __init__(self, config: ModelConfig) -> None:
        h, d = config.hidden_size, config.head_dim
        q_size, kv_size = config.num_heads * d, config.num_kv_heads * d
        super().__init__({"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}, h, config.attention_bias)
        self.o_proj = Linear(q_size, h, bias=config.o_proj_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_eps)
            self.k_norm = RMSNorm(d, config.rms_eps)


class MLP(FusedProjections):
    """SwiGLU's weights under HF names; gate/up are views of the fused gate-up weight. The
    arithmetic is `LayerMath`'s (through the routed linear), not a forward of its own."""

    def __init__(self, config: ModelConfig) -> None:
        h, i = config.hidden_size, config.intermediate_size
        super().__init__({"gate_proj": i, "up_proj": i}, h, bias=False)
        self.down_proj = Linear(i, h, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.mlp = MLP(config)


class RotaryEmbedding(nn.Module):
    """Holds the fp32 inverse frequencies; cos/sin are computed per token, as HF does."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        # Follow device moves but stay fp32 (a bf16 cast would shift every angle), and
        # recompute rather than convert, so a meta-built model gets real frequencies.
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        self.inv_freq = rope_inv_freq(self.config).to(device) if device.type != "meta" else self.inv_freq.float()
        return self

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, computed once per step for `apply_rotary`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """HF's non-interleaved rotary layout on [T, H, D] with per-token cos and `signed_sin(sin)`
    [T, D]. HF's `rotate_half(x) * sin` equals the halves swapped times `signed_sin(sin)` bit for
    bit (a negation is exact), in two kernels fewer per call. The halves are swapped as a flip
    of a [2, D / 2] view, not a roll of D (which indexes every element modulo D): compiled, the
    same bits in 18-30% less kernel time at long prompts' prefill on an H200."""
    halves = (2, x.shape[-1] // 2)
    pairs = x.unflatten(-1, halves)
    rotated = pairs * cos.unflatten(-1, halves)[:, None] + pairs.flip(-2) * sin_signed.unflatten(-1, halves)[:, None]
    return rotated.flatten(-2)


class LayerMath:
    """A layer's arithmetic outside attention, as functions of tensors only: the weights are
    arguments, so one function (and, compiled, one set of kernels) serves every layer.

    `compile(backend)` swaps in `torch.compile`d versions. Eager and graph paths then run the
    same fused kernels, so their tokens stay equal; the compiled numbers differ from the
    uncompiled ones in the last bits (a fused kernel keeps intermediates in fp32), which is
    why it is a choice and not the default. The first call of each shape compiles: graph
    runners warm up before they capture, so no compile happens under capture.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        # Every projection: F.linear, or the platform's kernel for few rows (`use_linear`).
        self.linear: LinearFn = F.linear
        self.linear_support: LinearSupport | None = None
        self.pre_attention: Callable[..., tuple[torch.Tensor, ...]] = self._pre_attention
        self.mlp: Callable[..., tuple[torch.Tensor, torch.Tensor]] = self._mlp_block
        self.final_norm: Callable[..., torch.Tensor] = self._final_norm

    def use_linear(self, support: LinearSupport | None) -> None:
        """Route every projection through `routed_linear(support)` (None: F.linear everywhere)."""
        self.linear, self.linear_support = routed_linear(support), support

    def compile(self, backend: str | Callable[..., Any] = "inductor",
                options: Mapping[str, bool | int | str] | None = None) -> None:
        """`options`: inductor settings (`torch.compile(options=...)`), for backend "inductor" only
        (`EngineConfig.compile_layers` names a backend `check_compile_backend` accepted)."""
        assert not options or backend == "inductor", f"compile options {dict(options)!r} are inductor settings"
        settings: dict[str, str | int | bool | Callable[..., Any]] | None = dict(options) if options else None

        def compiled(fn: Callable[..., Any], *token_args: int) -> Callable[..., Any]:
            return _token_dim_dynamic(torch.compile(_own_code(fn), backend=backend, fullgraph=True, options=settings),
                                      token_args)

        # The positions of the arguments with a token dimension.
        self.pre_attention = compiled(self._pre_attention, 0, 1, 7, 8)  # residual, pending, cos, sin
        self.mlp = compiled(self._mlp_block, 0, 1)  # residual, pending
        self.final_norm = compiled(self._final_norm, 0, 1)  # residual, pending

    # The residual stream. An output projection (o_proj, down_proj) reaches the residual in one
    # of two ways. `into_residual` adds it inside the product where the general matrix multiply
    # runs it: an in-place addmm reads the residual in the GEMM's epilogue, so the next norm
    # only reads the residual (at a long prompt's prefill that halves the norms' memory
    # traffic). Where the product can't (the platform's few-row kernel, a bias, a tensor-
    # parallel partial sum that must be all-reduced first) the projection is "pending", and
    # the next norm adds it in the norm's kernel. The products stay out of `torch.compile`:
    # compiled, an in-place addmm of an input becomes a copy, an addmm and a copy back.
    def into_residual(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor | None:
        """Add `x @ weight.T (+ bias)` to `residual` in place and return None, or return the
        projection for the next norm to add (see above)."""
        if bias is None and not takes_kernel(self.linear_support, x, weight):
            residual.addmm_(x, weight.t())
            return None
        return self.linear(x, weight, bias)

    def _pre_attention(
        self, residual: torch.Tensor, pending: torch.Tensor | None, norm_weight: torch.Tensor,
        qkv_weight: torch.Tensor, qkv_bias: torch.Tensor | None, q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer before's pending MLP output added to the residual (None: nothing pending),
        input norm, fused QKV projection, q/k norms (Qwen3) and rotary: the residual, q [T, H, D],
        k and v [T, Hkv, D]."""
        config = self.config
        heads, kv_heads, dim = config.num_heads, config.num_kv_heads, config.head_dim
        if pending is not None:
            residual = residual + pending
        t = residual.shape[0]
        qkv = self.linear(rms_norm(residual, norm_weight, config.rms_eps), qkv_weight, qkv_bias)
        q_size, kv_size = heads * dim, kv_heads * dim
        v = qkv[:, q_size + kv_size :].reshape(t, kv_heads, dim)  # a view: attention copies it into the pool
        if q_norm_weight is not None and k_norm_weight is not None:
            q = rms_norm(qkv[:, :q_size].reshape(t, heads, dim), q_norm_weight, config.rms_eps)
            k = rms_norm(qkv[:, q_size : q_size + kv_size].reshape(t, kv_heads, dim), k_norm_weight, config.rms_eps)
            return residual, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
        # q and k rotate together: they are adjacent in the fused projection's output.
        qk = apply_rotary(qkv[:, : q_size + kv_size].reshape(t, heads + kv_heads, dim), cos, sin)
        return residual, qk[:, :heads], qk[:, heads:], v

    def _mlp_block(
        self, residual: torch.Tensor, pending: torch.Tensor | None, o_bias: torch.Tensor | None,
        norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual after the pending attention output (tensor parallel: all-reduced, plus
        o_proj's bias, left out of the partial sums) and SwiGLU's activation, the down
        projection's input (tensor parallel: this rank's slice of the intermediate width)."""
        if pending is not None:
            residual = residual + pending if o_bias is None else residual + pending + o_bias
        gate, up = self.linear(rms_norm(residual, norm_weight, self.config.rms_eps), gate_up_weight, None).chunk(
            2, dim=-1)
        return residual, F.silu(gate) * up

    def _final_norm(self, residual: torch.Tensor, pending: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(residual if pending is None else residual + pending, weight, self.config.rms_eps)


def check_compile_backend(backend: object, label: str) -> None:
    """A torch.compile backend: a registered name (e.g. "inductor") or a backend callable."""
    if callable(backend):
        return
    if not (isinstance(backend, str) and backend):
        raise ValueError(f"{label} = {short_repr(backend)} must be a torch.compile backend name "
                         "(e.g. 'inductor') or a backend callable")
    import torch._dynamo

    if backend not in torch._dynamo.list_backends(exclude_tags=()):  # any registered one; the usual ones named
        raise ValueError(f"{label} = {short_repr(backend)} is not a torch.compile backend of this torch; use one of "
                         f"{', '.join(torch._dynamo.list_backends())} (e.g. 'inductor'), or a backend callable")


def _own_code(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (bound) over a copy of its function's code object. Dynamo keeps the graphs it
    compiled on the code object, at most `recompile_limit` (8) of them, and under
    `fullgraph=True` a ninth is an error: without a copy per model, a process whose ninth model
    shape compiles these methods would fail, and every model's graphs would stay cached."""
    fn = method.__func__  # type: ignore[attr-defined]
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return types.MethodType(copy, method.__self__)  # type: ignore[attr-defined]


def _token_dim_dynamic(compiled: Callable[..., Any], token_args: tuple[int, ...]) -> Callable[..., Any]:
    """Call `compiled` with the token dimension (dim 0) of the tensors at `token_args` marked
    dynamic (an argument that is None is left alone), so every token count above 1 shares one
    compiled graph (one set of kernels, hence the same numbers for a padded graph batch and the
    eager batch it stands for); a count of 1 gets its own."""

    def call(*args: Any) -> Any:
        for index in token_args:
            if args[index] is not None:
                torch._dynamo.maybe_mark_dynamic(args[index], 0)
        return compiled(*args)

    return call


class DecoderStack(nn.Module):
    """HF's `model`: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaDecoder(nn.Module):
    """One decoder for the Llama family; weights start uninitialised (load or init them).

    `tensor_parallel=(plan, rank)` (or a `RankShard`) builds one rank's shard of the model
    (see `parallel`): its heads, KV heads, MLP slice and vocabulary rows, under the HF names,
    each parameter this rank's slice of the HF tensor (`RankShard.slice_of`). It runs once
    `use_communicator(group.comm)` gave it its group. `config` stays the whole model's (the
    vocabulary requests are checked against, the width of `logits`); `local_config` holds the
    shapes this rank computes (the KV cache and attention are sized from it). A plan of one
    rank is no plan: the decoder is exactly the single-device one.
    """

    def __init__(self, config: ModelConfig,
                 tensor_parallel: RankShard | tuple[TensorParallelPlan, int] | None = None) -> None:
        super().__init__()
        assert isinstance(config, ModelConfig), f"LlamaDecoder: config is a {type(config).__name__}, not a ModelConfig"
        shard = RankShard.of(tensor_parallel) if tensor_parallel is not None else None
        assert shard is None or shard.plan.config == config, "the plan was made for another ModelConfig"
        self.config = config
        self.shard: RankShard | None = shard if shard is not None and shard.world_size > 1 else None
        self.local_config = self.shard.plan.rank_config() if self.shard is not None else config
        local = self.local_config
        self.model = DecoderStack(local)
        self.lm_head = Linear(local.hidden_size, local.vocab_size, bias=False)
        self.tie_weights()
        self.kv: KVCache | None = None
        self.layer_math = LayerMath(local)
        self.comm: Communicator | None = None
        # `layer_program()`, built at its first call, and the layers it was built for.
        self._program: list[Step] | None = None
        self._program_layers: tuple[nn.Module, ...] = ()

    def __getstate__(self) -> dict[str, Any]:
        # A copy (deepcopy, pickle) builds its own program: the kept steps are bound to this decoder.
        state = dict(super().__getstate__())
        state["_program"] = None
        return state

    def use_communicator(self, comm: Communicator) -> None:
        """The group this tensor-parallel shard runs in (`DeviceGroup.comm`); its rank and size
        must be the shard's (the engine refuses a shard of another rank or size: `shard_problem`).
        Call before `layer_program()` is taken (runners capture it)."""
        shard = self.shard
        assert shard is not None, "use_communicator: this decoder is not tensor-parallel"
        assert (comm.rank, comm.world_size) == (shard.rank, shard.world_size), \
            f"the communicator is rank {comm.rank} of {comm.world_size}, this shard is rank {shard.rank} of " \
            f"{shard.world_size}"
        self.comm = comm
        self._program = None  # the all-reduce steps hold the communicator: build them anew

    def _communicator(self) -> Communicator:
        assert self.comm is not None, "a tensor-parallel decoder runs once use_communicator(group.comm) gave it a group"
        return self.comm

    def materialize(self, device: torch.device) -> LlamaDecoder:
        """Uninitialised storage on `device` for a meta-built decoder: the one device allocation.
        (`Module.to_empty` would do it through `empty_like`, whose meta path imports the compiler stack.)"""
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        self.tie_weights()  # the move made new parameters: share the embedding again
        return self

    def shard_for(self, tensor_parallel: RankShard | tuple[TensorParallelPlan, int]) -> LlamaDecoder:
        """A new decoder holding rank's shard of this whole (unsharded) decoder's weights, on its
        device and in its dtype; the slices are the ones `load_checkpoint` reads for that rank."""
        assert self.shard is None, "shard_for: this decoder is already a tensor-parallel shard"
        shard, weight = RankShard.of(tensor_parallel), next(self.parameters())
        with torch.device("meta"):
            part = LlamaDecoder(self.config, shard).to(weight.dtype)
        part.materialize(weight.device)
        params = dict(part.named_parameters())
        with torch.no_grad():
            for name, full in self.named_parameters():
                params[name].copy_(shard.take(name, full))
        part.process_weights()
        part.train(self.training)
        return part

    def compile_layers(self, backend: str | Callable[..., Any] = "inductor",
                       options: Mapping[str, bool | int | str] | None = None) -> None:
        """Run every layer's arithmetic outside attention through `torch.compile` (see
        `LayerMath`): fewer, fused kernels per decode step. `options` are inductor settings (the
        engine passes the platform's `compile_support()`). Call it before graphs are captured
        (the engine does, for `EngineConfig.compile_layers`); captured graphs keep the kernels
        they were captured with."""
        self.layer_math.compile(backend, options)

    def use_linear(self, support: LinearSupport | None) -> None:
        """Run every projection (QKV, o_proj, gate-up, down, the tensor-parallel partials and
        lm_head) through `routed_linear(support)`: the platform's kernel for inputs of at most
        `support.max_rows` rows in a dtype it declares, F.linear for the rest; None restores
        F.linear everywhere. Call it before graphs are captured (the engine does, before
        `compile_layers`): a captured graph keeps the kernels it was captured with."""
        self.layer_math.use_linear(support)

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config ties them (after a move, too)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return list(self.model.layers)  # type: ignore[arg-type]  # ModuleList items are typed Module

    def process_weights(self) -> None:
        """Nothing to rebuild after a load or update: the fused QKV and gate-up weights are the
        storage their HF-named parameters view."""

    # -- the layer stack, as a program for runners --------------------------------
    def layer_program(self) -> list[Step]:
        """Graph-safe steps and breakable attention ops for the whole layer stack.

        Inputs in the state: "hidden" [T, H] (embedded tokens; the residual stream starts
        as this tensor and is added to in place), "positions" [T], and optionally
        `OUTPUT_ROWS` [R]. Output: "hidden" [T, H] after the final norm, or [R, H]
        when the last layer narrowed to the output rows (a step that is not a pure decode:
        see `graphs.program.OUTPUT_ROWS`). Between layers the state carries the residual and,
        when a projection could not add itself to it, that projection (`PENDING`), which the
        next norm adds.

        Kept once built (each call returns a new list of the same steps), since building it
        costs ~0.3 ms of host time an eager step's device would wait for. A step looks up the
        weights, the KV cache and the layer arithmetic when it runs, so moves, sleep and wake,
        weight updates, `compile_layers` and `use_linear` leave it valid; a layer of
        `model.layers` replaced by another module, or a new communicator, builds it anew. (A
        submodule replaced inside a layer is not seen: replace the layer.)
        """
        layers = tuple(self.model.layers)
        if self._program is None or self._program_layers != layers:
            self._program, self._program_layers = self._build_program(), layers
        assert self._program is not None
        return list(self._program)

    def _build_program(self) -> list[Step]:
        steps: list[Step] = []
        for index, layer in enumerate(self.decoder_layers):
            steps.append(GraphStep(f"layer{index}.pre_attention", self._pre_attention(layer, first=index == 0)))
            steps.append(BreakStep(f"layer{index}.attention", self._attention(index)))
            steps += self._post_attention(index, layer)
        steps.append(GraphStep("final_norm", self._final_norm))
        return steps

    def _post_attention(self, index: int, layer: DecoderLayer) -> list[Step]:
        """o_proj, the MLP up to SwiGLU, down_proj. One device, each projection is added to the
        residual as `LayerMath.into_residual` says. Tensor parallel, both projections are
        row-parallel: each writes this rank's partial sum, all-reduced in place (a graph step
        when the communicator's collectives can be captured, a break otherwise: the segments
        around it stay graphs) and left pending for the next norm to add."""
        attn, mlp, layer_math = layer.self_attn, layer.mlp, self.layer_math
        # Tensor parallel, o_proj's bias is added once, after the sum; on one device inside the
        # projection, as HF adds it.
        sharded = self.shard is not None

        def project(state: StackState, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
            if sharded:
                state[PENDING] = layer_math.linear(x, weight, None)
                return
            pending = layer_math.into_residual(state["residual"], x, weight, bias)
            if pending is not None:  # the norm before this projection took the last one
                state[PENDING] = pending

        def o_proj(state: StackState) -> None:
            attn_out = state["attn_out"]
            project(state, attn_out.reshape(attn_out.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)

        def mlp_block(state: StackState) -> None:
            state["residual"], state["mlp_act"] = layer_math.mlp(
                state["residual"], state.pop(PENDING, None), attn.o_proj.bias if sharded else None,
                layer.post_attention_layernorm.weight, mlp.fused_weight,
            )

        def down_proj(state: StackState) -> None:
            project(state, state.pop("mlp_act"), mlp.down_proj.weight, None)

        steps: list[Step] = [GraphStep(f"layer{index}.o_proj", o_proj)]
        if self.shard is not None:
            steps.append(self._all_reduce_pending(f"layer{index}.o_proj.all_reduce"))
        steps += [GraphStep(f"layer{index}.mlp", mlp_block), GraphStep(f"layer{index}.down_proj", down_proj)]
        if self.shard is not None:
            steps.append(self._all_reduce_pending(f"layer{index}.down_proj.all_reduce"))
        return steps

    def _all_reduce_pending(self, name: str) -> Step:
        comm = self._communicator()

        def reduce(state: StackState) -> None:
            comm.all_reduce(state[PENDING])

        if comm.graph_capturable:
            return GraphStep(name, reduce)
        return BreakStep(name, lambda state, num_tokens, meta: reduce(state))

    def _pre_attention(self, layer: DecoderLayer, first: bool) -> Callable[[StackState], None]:
        config = self.local_config
        attn = layer.self_attn
        q_norm = attn.q_norm if config.qk_norm else None
        k_norm = attn.k_norm if config.qk_norm else None

        def run(state: StackState) -> None:
            if first:
                state["residual"] = state["hidden"]
                # The rotary tables depend only on the positions: once per step, for every layer.
                cos, sin = self.model.rotary_emb(state["positions"], state["hidden"].dtype)
                state["rotary_cos"], state["rotary_sin"] = cos, signed_sin(sin)
            state["residual"], state["q"], state["k"], state["v"] = self.layer_math.pre_attention(
                state["residual"], state.pop(PENDING, None), layer.input_layernorm.weight, attn.fused_weight,
                attn.fused_bias, q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None, state["rotary_cos"], state["rotary_sin"],
            )
            residual = state["residual"]
            state["attn_out"] = torch.empty(
                residual.shape[0], config.num_heads, config.head_dim, dtype=residual.dtype, device=residual.device
            )

        return run

    def _final_norm(self, state: StackState) -> None:
        state["hidden"] = self.layer_math.final_norm(state["residual"], state.pop(PENDING, None),
                                                     self.model.norm.weight)

    def _attention(self, index: int) -> Callable[[StackState, int, AttentionMetadata], None]:
        config = self.local_config
        scale = config.head_dim**-0.5
        last_layer = index == config.num_layers - 1

        def run(state: StackState, num_tokens: int, meta: AttentionMetadata) -> None:
            """Write this step's K/V into the paged cache, then attend in place through the
            chosen backend: no gather of the context, no copy of KV heads for GQA."""
            kv = self.kv
            assert kv is not None, "a step runs with the cache its engine allocated (forward refuses without one)"
            k_cache, v_cache = kv.k[index], kv.v[index]
            backend = meta.backend
            backend.write_kv(k_cache, v_cache, state["k"][:num_tokens], state["v"][:num_tokens],
                             meta.paged.slot_mapping)
            rows = state.get(OUTPUT_ROWS) if last_layer and not meta.decode else None
            if rows is None:
                query, out = state["q"][:num_tokens], state["attn_out"]
                if meta.decode:
                    backend.decode(query, k_cache, v_cache, meta.paged, scale=scale,
                                   sliding_window=config.sliding_window, out=out[:num_tokens])
                    return
                # A backend declaring `step_kv` reads whole prompts' K/V where the projection left
                # them; others read the cache alone.
                prefill: Callable[..., torch.Tensor] = backend.prefill
                if backend.capability.step_kv:
                    prefill = functools.partial(backend.prefill, key=state["k"][:num_tokens],
                                                value=state["v"][:num_tokens])
                if num_tokens != out.shape[0]:  # a graph bucket's padded rows
                    prefill(query, k_cache, v_cache, meta.paged, scale=scale, sliding_window=config.sliding_window,
                            out=out[:num_tokens])
                else:  # the output as the backend makes it: a dense kernel's own, not copied into `out`
                    state["attn_out"] = prefill(query, k_cache, v_cache, meta.paged, scale=scale,
                                                sliding_window=config.sliding_window)
                return
            # The step's KV is written, and past this point a row feeds only its own output:
            # the last layer attends, projects and runs its MLP for the output rows alone (at a
            # long prompt's prefill that is one row per request, not thousands).
            del state[OUTPUT_ROWS]
            out = state["attn_out"].new_empty((rows.shape[0], *state["attn_out"].shape[1:]))  # rows may repeat
            backend.decode(state["q"][:num_tokens].index_select(0, rows), k_cache, v_cache,
                           decode_metadata_for_rows(meta.paged, rows), scale=scale,
                           sliding_window=config.sliding_window, out=out)
            state["attn_out"], state["residual"] = out, state["residual"].index_select(0, rows)

        return run

    # -- eager forward ------------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return self.model.embed_tokens(input_ids)
        # Vocabulary-parallel: ids outside this rank's rows embed as zeros; the sum over ranks
        # is then exactly the one row that holds each id.
        rows = self.shard.slice_of("model.embed_tokens.weight")
        assert rows is not None
        local = input_ids - rows.start
        outside = (local < 0) | (local >= rows.count)
        hidden = F.embedding(local.clamp(0, rows.size - 1), self.model.embed_tokens.weight)
        return self._communicator().all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def logits(self, hidden: torch.Tensor, last_token_index: torch.Tensor) -> torch.Tensor:
        logits = self.layer_math.linear(hidden.index_select(0, last_token_index), self.lm_head.weight,
                                        self.lm_head.bias).float()
        if self.shard is None:
            return logits
        # Every rank's vocabulary rows, in rank order; the last shard's padding rows cut off.
        return self._communicator().all_gather(logits, dim=-1)[:, : self.config.vocab_size]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T] ids -> [T, H] hidden states after the final norm (this step's KV written), or
        those of `rows` ([R] int64 token indices) only, computing no more of the last layer
        than they need."""
        if self.kv is None:  # a model run by hand, outside an engine: refused before any layer runs
            raise RuntimeError(
                "model.kv is None: assign a KVCache (model.kv = KVCache(model.local_config, num_blocks, block_size, "
                "device, dtype)) before forward, or run the model through GenerationEngine, which allocates one"
            )
        check_step_inputs("LlamaDecoder.forward", input_ids, meta)
        state: StackState = {"hidden": self.embed_tokens(input_ids), "positions": meta.positions}
        return run_for_rows(self.layer_program(), state, input_ids.numel(), meta, rows)
