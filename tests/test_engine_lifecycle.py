"""Engine guarantees under faults and misuse (CPU): steps are all-or-nothing, weight
updates atomic, the newest weights survive sleep, refused calls leave no state, and
nothing the engine runs records autograd history."""

import dataclasses
import re

import pytest
import torch

import torchhal
from torchhal.core.engine import EngineConfig, GenerationEngine, RequestState, WeightUpdateRejected
from torchhal.core.graphs import GraphRunner
from torchhal.core.model import AttentionMetadata, ModelConfig
from torchhal.platforms import ReleasePoint

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 10, [300, 3], [17, 18, 19, 20]]


def engine(platform=None, **overrides):
    return GenerationEngine(EngineConfig(**{"max_kv_slots": 512, **overrides}), platform=platform)


def outputs_of(e, prompts=PROMPTS, new_tokens=6):
    return [r.output for r in e.generate(prompts, new_tokens)]


@pytest.fixture(scope="module")
def reference():
    return outputs_of(engine())


def fail_once(monkeypatch, owner, name, error):
    """Make owner.name raise `error` on its next call only."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, flaky)


def slot_state(e):
    return (e.blocks.available, [(r.rid, r.kv_tokens) for r in e.running], [r.rid for r in e.waiting])


# -- a step is all-or-nothing -----------------------------------------------------------------
@pytest.mark.parametrize("where", ["metadata", "forward", "logits"])
def test_a_failed_step_gives_back_what_it_reserved_and_the_run_continues_unchanged(monkeypatch, reference, where):
    e = engine()
    rids = [e.add_request(p, 6) for p in PROMPTS[:3]]
    e.step()
    e.step()
    rids += [e.add_request(p, 6) for p in PROMPTS[3:]]  # the failing step decodes 3 and admits 2 prefills
    before = slot_state(e)
    error = ValueError(f"simulated failure in {where}")
    if where == "metadata":
        fail_once(monkeypatch, AttentionMetadata, "build", error)
    elif where == "forward":
        fail_once(monkeypatch, e.runner, "forward", error)
    else:
        fail_once(monkeypatch, e.model, "logits", error)
    with pytest.raises(ValueError, match=f"simulated failure in {where}"):
        e.step()
    assert slot_state(e) == before  # no decode slot kept, no prefill left admitted
    assert [r.state for r in e.waiting] == [RequestState.WAITING] * 2
    while any(rid not in e.results for rid in rids):
        e.step()
    assert [e.results[rid].output for rid in rids] == reference


def test_a_failed_step_rolls_back_when_the_platforms_oom_rule_itself_raises(monkeypatch, reference):
    # The rule was asked before the rollback: its own error escaped, the step's KV stayed
    # reserved, and its requests were later failed as too long for the pool.
    from torchhal.platforms import TorchhalPluginWarning

    e = engine()
    rids = [e.add_request(p, 6) for p in PROMPTS[:3]]
    e.step()
    before = slot_state(e)

    def fragile_rule(error):
        return "out of memory" in error.args[0]  # IndexError for an error without a message

    monkeypatch.setattr(e.platform, "is_out_of_memory", fragile_rule)
    fail_once(monkeypatch, e.runner, "forward", ValueError())
    with pytest.warns(TorchhalPluginWarning, match="is_out_of_memory raised IndexError"), \
            pytest.raises(ValueError):
        e.step()
    assert slot_state(e) == before
    while any(rid not in e.results for rid in rids):
        e.step()
    assert [e.results[rid].output for rid in rids] == reference[:3]


def test_a_step_interrupted_by_the_user_rolls_back_too(monkeypatch):
    e = engine()
    e.add_request(PROMPTS[0], 4)
    e.step()
    before = slot_state(e)
    fail_once(monkeypatch, e.runner, "forward", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        e.step()
    assert slot_state(e) == before


def test_generate_interrupted_while_queueing_its_prompts_leaves_none_queued(monkeypatch):
    # The prompts queued before the interrupt stayed, with no caller to collect them: they
    # blocked sleep and flush_cache, and their results stayed in the engine for ever.
    e = engine()
    real_add, queued = e.requests.add, []

    def add_then_interrupt(prompt, max_new_tokens):
        if len(queued) == 2:
            raise KeyboardInterrupt
        queued.append(real_add(prompt, max_new_tokens))
        return queued[-1]

    monkeypatch.setattr(e.requests, "add", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        e.generate([[1, 2, 3], [0, 1], [9, 8, 7], [4]], 3)
    monkeypatch.undo()
    assert len(queued) == 2 and e.pending() is None and not e.results
    assert outputs_of(e) == outputs_of(engine())


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_oom_while_building_the_batch_is_handled_like_oom_in_forward(empties, monkeypatch, reference, step):
    e = engine()
    rids = [e.add_request(p, 6) for p in PROMPTS]
    oom = torch.OutOfMemoryError("simulated: metadata copy")
    if step == "prefill":  # prefill metadata comes from host lists
        fail_once(monkeypatch, AttentionMetadata, "build", oom)
    else:  # decode metadata from the device rows the host updates
        e.step()
        fail_once(monkeypatch, e.executor.rows, "prepare", oom)
    assert e.step() == []  # no exception: the batch is retracted and retried
    assert empties == [ReleasePoint.OOM]
    while any(rid not in e.results for rid in rids):
        e.step()
    assert [e.results[rid].output for rid in rids] == reference


# -- weight updates are atomic --------------------------------------------------------------------
def params(e):
    return dict(e.model.named_parameters())


def early_zeros(e, count=2):
    """The first weights of the model, zeroed: a valid start of a batch that must not land."""
    return [(name, torch.zeros_like(p)) for name, p in list(params(e).items())[:count]]


def snapshot(e):
    state = {name: p.detach().clone() for name, p in e.model.named_parameters()}
    state.update({f"buffer {name}": b.clone() for name, b in e.model.named_buffers()})  # derived weights too
    return state


def assert_unchanged(e, before):
    now = snapshot(e)
    for name, value in now.items():
        assert torch.equal(value, before[name]), f"{name} changed by a refused update"
    e.model.process_weights()  # derived weights were consistent with the (old) parameters
    for name, value in snapshot(e).items():
        assert torch.equal(value, now[name]), f"{name} was stale"


@pytest.mark.parametrize("bad", ["sparse", "meta"])
def test_an_uncopyable_tensor_late_in_a_batch_changes_nothing(bad):
    e = engine()
    before, outputs = snapshot(e), outputs_of(e, PROMPTS[:2])
    name, target = [(n, p) for n, p in params(e).items() if p.dim() == 2][-1]
    late = torch.ones(target.shape).to_sparse() if bad == "sparse" else torch.empty(target.shape, device="meta")
    with pytest.raises(ValueError, match=f"nothing applied.*'{re.escape(name)}'.*{bad}"):
        e.update_weights_from_tensors([*early_zeros(e), (name, late)])
    assert e.weight_version == 0
    assert_unchanged(e, before)
    assert outputs_of(e, PROMPTS[:2]) == outputs


def test_a_conversion_that_fails_while_staging_changes_nothing():
    e = engine(dtype=torch.float32)
    before = snapshot(e)
    name, target = list(params(e).items())[-1]

    class Unconvertible(torch.Tensor):
        def to(self, *args, **kwargs):
            raise RuntimeError("cannot leave its storage")

    late = torch.zeros(target.shape, dtype=torch.float64).as_subclass(Unconvertible)
    with pytest.raises(ValueError, match=f"nothing applied: '{re.escape(name)}' cannot be converted.*cannot leave"):
        e.update_weights_from_tensors([*early_zeros(e), (name, late)])
    assert_unchanged(e, before)


def test_a_tensor_subclass_that_cannot_be_copied_changes_nothing():
    e = engine()
    before = snapshot(e)
    name, target = list(params(e).items())[-1]

    class RefusesToBeCopied(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.Tensor.copy_:
                raise RuntimeError("this tensor cannot be copied")
            return super().__torch_function__(func, types, args, kwargs or {})

    late = torch.zeros_like(target).as_subclass(RefusesToBeCopied)
    with pytest.raises(ValueError, match=f"nothing applied: '{re.escape(name)}'.*cannot be copied"):
        e.update_weights_from_tensors([*early_zeros(e), (name, late)])
    assert e.weight_version == 0
    assert_unchanged(e, before)


MALFORMED_UPDATES = {
    "list name": (lambda good: [("lm_head.weight", good), (["lm_head.weight"], good)],
                  r"weight name \['lm_head.weight'\] is a list; names are str"),
    "dict name": (lambda good: [("lm_head.weight", good), ({"name": 1}, good)], r"weight name \{'name': 1\} is a dict"),
    "None name": (lambda good: [("lm_head.weight", good), (None, good)], "weight name None is a NoneType"),
    "tuple key": (lambda good: {"lm_head.weight": good, ("a", "b"): good}, r"weight name \('a', 'b'\) is a tuple"),
    "list value": (lambda good: [("lm_head.weight", good), ("model.norm.weight", [1.0])],
                   r"'model.norm.weight' is a list, not a torch.Tensor of shape \(128,\)"),
    "None value": (lambda good: {"lm_head.weight": good, "model.norm.weight": None},
                   "'model.norm.weight' is a NoneType"),
    "triple": (lambda good: [("lm_head.weight", good), ("model.norm.weight", good, 1)],
               r"entry 1 \('model.norm.weight', Tensor\(512, 128\) torch.float32, 1\) is not a \(name, tensor\)"),
    "list pair": (lambda good: [("lm_head.weight", good), ["model.norm.weight", good]],
                  r"entry 1 \['model.norm.weight', Tensor\(512, 128\) torch.float32\] is not a \(name, tensor\)"),
    "None": (lambda good: None, "the update is a NoneType; pass a dict of name -> tensor or an iterable"),
    "a tensor": (lambda good: good, "the update is a Tensor; pass a dict"),
    "a str": (lambda good: "lm_head.weight", "the update is a str; pass a dict"),
}


@pytest.mark.parametrize("form", list(MALFORMED_UPDATES))
def test_a_malformed_update_is_rejected_naming_it_with_nothing_applied(form):
    e = engine()
    before = snapshot(e)
    build, message = MALFORMED_UPDATES[form]
    with pytest.raises(WeightUpdateRejected, match="nothing applied: .*" + message):
        e.update_weights_from_tensors(build(torch.zeros_like(e.model.lm_head.weight)))
    assert e.weight_version == 0
    assert_unchanged(e, before)


def test_a_write_that_fails_part_way_refuses_generation_until_rewritten(monkeypatch):
    e = engine()
    other = engine(model=ModelConfig(seed=5))
    expected = outputs_of(other, PROMPTS[:2])
    new_weights = {k: v.detach().clone() for k, v in other.model.named_parameters()}
    fail_once(monkeypatch, e.model, "process_weights", RuntimeError("simulated device fault"))
    with pytest.raises(RuntimeError, match="failed part-way.*simulated device fault"):
        e.update_weights_from_tensors(new_weights)
    assert e.weight_version == 0
    with pytest.raises(RuntimeError, match="half-written"):
        e.generate(PROMPTS[:2], 6)
    assert e.pending() is None  # the refused generate queued nothing
    e.update_weights_from_tensors(new_weights)
    assert e.weight_version == 1
    assert outputs_of(e, PROMPTS[:2]) == expected


def test_ctrl_c_during_a_weight_write_stays_a_keyboard_interrupt_and_still_refuses_generation(monkeypatch):
    # It was turned into WeightUpdateIncomplete: a server stopping on KeyboardInterrupt went on
    # running, its update call merely failed.
    e = engine()
    new_weights = {k: v.detach().clone() for k, v in engine(model=ModelConfig(seed=5)).model.named_parameters()}
    fail_once(monkeypatch, e.model, "process_weights", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        e.update_weights_from_tensors(new_weights)
    with pytest.raises(RuntimeError, match="half-written"):
        e.generate(PROMPTS[:2], 6)


class Peers:
    """Stands in for a tensor-parallel group's verdicts (`WeightUpdater.agree`): this rank is
    rank 0; `failing` says which of the other ranks fail the n-th verdict."""

    def __init__(self, *failing: list[int]) -> None:
        self.failing, self.asked = list(failing), []

    def __call__(self, failed: bool, replicated: int) -> tuple[list[int], list[int]]:
        self.asked.append(failed)
        peers = self.failing[len(self.asked) - 1] if len(self.asked) <= len(self.failing) else []
        return ([0] if failed else []) + peers, []


def test_a_write_that_fails_on_a_peer_refuses_generation_on_every_rank():
    """Rank 1's write failed after the batch was agreed: rank 0's own write went through, but
    the ranks' weights now differ, so rank 0 refuses generation too (before, it stepped alone
    and waited out the group's timeout in the first collective)."""
    from torchhal.core.engine.weights import WeightUpdater

    e = engine()
    new_weights = {k: v.detach().clone() for k, v in engine(model=ModelConfig(seed=5)).model.named_parameters()}
    peers = Peers([], [1])  # agreed before the write; rank 1's write failed
    e.weights = WeightUpdater(e.model, agree=peers)
    with pytest.raises(RuntimeError, match=r"failed part-way on rank\(s\) \[1\] of the group"):
        e.update_weights_from_tensors(new_weights)
    assert peers.asked == [False, False]
    with pytest.raises(RuntimeError, match="half-written"):
        e.generate(PROMPTS[:2], 6)
    e.weights.agree = Peers()
    e.update_weights_from_tensors(new_weights)  # rewritten on every rank: generation is back
    assert len(outputs_of(e, PROMPTS[:2])) == 2


@pytest.mark.parametrize("stage", ["staging", "writing"])
def test_ctrl_c_on_one_rank_tells_its_peers_before_it_propagates(monkeypatch, stage):
    """Ctrl-C while this rank staged its batch once skipped the verdict its peers wait for: they
    waited out the group's timeout. Now the peers hear a refusal (staging) or a failed write."""
    from torchhal.core.engine.weights import WeightUpdater

    e = engine()
    new_weights = {k: v.detach().clone() for k, v in engine(model=ModelConfig(seed=5)).model.named_parameters()}
    peers = Peers()
    e.weights = WeightUpdater(e.model, agree=peers)
    if stage == "staging":
        monkeypatch.setattr(WeightUpdater, "_stage", lambda self, tensor, param: (_ for _ in ()).throw(
            KeyboardInterrupt()))
    else:
        fail_once(monkeypatch, e.model, "process_weights", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        e.update_weights_from_tensors(new_weights)
    assert peers.asked == ([True] if stage == "staging" else [False, True])


@pytest.mark.parametrize("first, then", [("state_dict", "named_parameters"), ("named_parameters", "state_dict")])
def test_a_tied_weight_rewritten_under_its_other_name_clears_a_failed_writes_refusal(monkeypatch, first, then):
    # The refusal tracked names: a failed state_dict() update (both tied names) stayed refused
    # after a named_parameters() one (one name) rewrote every parameter.
    tied = ModelConfig(tie_word_embeddings=True)
    e = engine(model=tied)
    other = engine(model=dataclasses.replace(tied, seed=5))
    expected = outputs_of(other, PROMPTS[:2])
    updates = {"state_dict": dict(other.model.state_dict()), "named_parameters": dict(other.model.named_parameters())}
    assert ("lm_head.weight" in updates["state_dict"]) and ("lm_head.weight" not in updates["named_parameters"])
    fail_once(monkeypatch, e.model, "process_weights", RuntimeError("simulated device fault"))
    with pytest.raises(RuntimeError, match="failed part-way"):
        e.update_weights_from_tensors(updates[first])
    e.update_weights_from_tensors(updates[then])
    assert outputs_of(e, PROMPTS[:2]) == expected


def test_finite_check_is_on_by_default_and_can_be_turned_off():
    off = engine(check_finite_weights=False)
    name, target = list(params(off).items())[-1]
    nan = torch.full_like(target, float("nan"))
    assert off.update_weights_from_tensors({name: nan}).weight_version == 1
    e = engine()
    before = snapshot(e)
    with pytest.raises(ValueError, match=f"nothing applied: '{re.escape(name)}' holds NaN or infinite"):
        e.update_weights_from_tensors([*early_zeros(e), (name, nan)])
    assert_unchanged(e, before)
    huge = torch.full(target.shape, 1e300, dtype=torch.float64)  # finite, inf once in fp32
    with pytest.raises(ValueError, match="NaN or infinite"):
        e.update_weights_from_tensors({name: huge})


# -- sleep / update / wake ----------------------------------------------------------------------
class CopyingPinPlatform:
    """The CPU platform without virtual memory (its engines sleep by host offload), and whose
    `pin_memory` returns a copy (as on every accelerator)."""

    virtual_memory_support = None

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def pin_memory(self, tensor):
        return tensor.clone()


class TaggingPinPlatform(CopyingPinPlatform):
    """Copies like an accelerator's pin and remembers the storage of every "pinned" copy."""

    def __init__(self, inner):
        super().__init__(inner)
        self.pinned: set[int] = set()

    def pin_memory(self, tensor):
        copy = tensor.clone()
        self.pinned.add(copy.untyped_storage().data_ptr())
        return copy

    def is_pinned(self, tensor):
        return tensor.untyped_storage().data_ptr() in self.pinned


@pytest.mark.parametrize("tied", [False, True])
def test_sleep_leaves_every_parameter_in_pinned_host_memory(make_registry, tied):
    # The decoder's q/k/v and gate/up parameters are views into fused storage: pinning
    # them one by one pinned detached copies and the move re-viewed unpinned storage.
    make_registry()
    platform = TaggingPinPlatform(torchhal.current_platform())
    e = GenerationEngine(EngineConfig(model=ModelConfig(tie_word_embeddings=tied), max_kv_slots=512),
                         platform=platform)
    before = outputs_of(e, PROMPTS[:3])
    e.release_memory_occupation()
    unpinned = [name for name, p in e.model.named_parameters() if not platform.is_pinned(p)]
    assert unpinned == []
    layer = e.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.untyped_storage().data_ptr() == \
        layer.self_attn.fused_weight.untyped_storage().data_ptr()  # still views of the fused weight
    assert (e.model.lm_head.weight is e.model.model.embed_tokens.weight) == tied
    e.resume_memory_occupation()
    assert outputs_of(e, PROMPTS[:3]) == before


@pytest.mark.parametrize("copying_pin", [True, False])
def test_a_weight_update_made_while_asleep_survives_wake(make_registry, copying_pin):
    make_registry()
    platform = torchhal.current_platform()
    e = engine(platform=CopyingPinPlatform(platform) if copying_pin else platform)
    other = engine(model=ModelConfig(seed=9))
    expected = outputs_of(other, PROMPTS[:3])
    assert outputs_of(e, PROMPTS[:3]) != expected
    e.release_memory_occupation()
    e.update_weights_from_tensors(other.model.named_parameters())
    e.resume_memory_occupation()
    assert outputs_of(e, PROMPTS[:3]) == expected
    e.release_memory_occupation()  # and a plain sleep/wake keeps them
    e.resume_memory_occupation()
    assert outputs_of(e, PROMPTS[:3]) == expected


def test_on_regions_the_weights_and_kv_cache_wake_under_the_addresses_they_slept_at(make_registry):
    make_registry()
    e = engine()
    before = outputs_of(e, PROMPTS[:3])
    awake = [p.data_ptr() for p in e.model.parameters()] + [e.model.kv.k.data_ptr(), e.model.kv.v.data_ptr()]
    e.release_memory_occupation()
    assert all(p.device.type == "cpu" for p in e.model.parameters())  # the backup, as host tensors
    e.resume_memory_occupation()
    assert [p.data_ptr() for p in e.model.parameters()] + [e.model.kv.k.data_ptr(), e.model.kv.v.data_ptr()] == awake
    assert outputs_of(e, PROMPTS[:3]) == before


class PinFailsAt(TaggingPinPlatform):
    """Pinned host memory runs out at the `fail_at`-th pin."""

    def __init__(self, inner, fail_at):
        super().__init__(inner)
        self.calls, self.fail_at = 0, fail_at

    def pin_memory(self, tensor):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated: cannot pin more host memory")
        return super().pin_memory(tensor)


def graph_engine(platform=None, **overrides):
    from torchhal.core.engine import DecodeGraphConfig, PrefillGraphConfig

    return engine(platform, prefill_graphs=PrefillGraphConfig(token_buckets=(8, 32), emulate=True),
                  decode_graphs=DecodeGraphConfig(batch_buckets=(4,), context_buckets=(64,), emulate=True),
                  **overrides)


def test_a_sleep_that_fails_part_way_leaves_the_engine_awake_as_it_was(make_registry, reference):
    # It left the engine "awake" with its graphs dropped and a third of its weights on the host.
    make_registry()
    platform = PinFailsAt(torchhal.current_platform(), fail_at=6)
    e = graph_engine(platform)
    with pytest.raises(RuntimeError, match="cannot pin more host memory"):
        e.release_memory_occupation()
    assert not e.asleep and e.model.kv is not None and e.runner.graphs_enabled
    assert outputs_of(e) == reference
    platform.fail_at = None
    e.release_memory_occupation()  # and it can sleep once memory is there
    e.resume_memory_occupation()
    assert outputs_of(e) == reference


@pytest.mark.parametrize("where", ["prefill graphs", "decode graphs", "kv cache"])
def test_a_wake_that_fails_part_way_leaves_the_engine_asleep_and_can_be_retried(monkeypatch, reference, where):
    # Host offload: marked awake first, a retry was refused ("not asleep") and steps met a
    # half-captured runner (a bare KeyError for a missing bucket).
    import torchhal.core.graphs.runner as graph_runner

    e = graph_engine(CopyingPinPlatform(torchhal.current_platform()))
    e.release_memory_occupation()
    oom = torch.OutOfMemoryError(f"simulated: out of memory in the {where}")
    if where == "prefill graphs":
        real, made = graph_runner._Bucket, []

        def second_bucket_fails(*args):  # the first bucket is captured, the second is not
            made.append(1)
            if len(made) == 2:
                raise oom
            return real(*args)

        monkeypatch.setattr(graph_runner, "_Bucket", second_bucket_fails)
    elif where == "decode graphs":
        fail_once(monkeypatch, e.decode_runner, "resume", oom)
    else:
        fail_once(monkeypatch, e, "_new_kv_cache", oom)
    with pytest.raises(torch.OutOfMemoryError, match=where):
        e.resume_memory_occupation()
    assert e.asleep and e.model.kv is None and not e.runner.graphs_enabled
    with pytest.raises(RuntimeError, match="asleep"):
        e.generate(PROMPTS, 6)
    monkeypatch.undo()
    e.resume_memory_occupation()
    assert e.runner.graphs_enabled and outputs_of(e) == reference


@pytest.mark.parametrize("tag", ["weights", "kv_cache"])
def test_a_region_that_fails_to_restore_leaves_its_tag_asleep_and_can_be_retried(monkeypatch, reference, tag):
    e = graph_engine()
    e.release_memory_occupation()
    regions = e.occupation.regions
    real = regions.restore

    def out_of_memory_for(name):
        if name == tag:
            raise torch.OutOfMemoryError(f"simulated: no memory for {name}")
        return real(name)

    monkeypatch.setattr(regions, "restore", out_of_memory_for)
    with pytest.raises(torch.OutOfMemoryError, match=tag):
        e.resume_memory_occupation()
    assert tag in e.asleep_tags and regions.released(tag)
    with pytest.raises(RuntimeError, match="asleep"):
        e.generate(PROMPTS, 6)
    monkeypatch.undo()
    e.resume_memory_occupation()
    assert not e.asleep and e.decode_runner.captures == 0 and outputs_of(e) == reference


def test_close_gives_the_kv_cache_back_at_once_and_frees_the_model_for_a_new_engine(reference):
    # Engine and model hold each other in reference cycles: without close() the KV cache lived
    # until a full garbage collection.
    import gc
    import weakref

    gc.disable()  # what close() gives back must not wait for a collection
    try:
        e = graph_engine()
        kv = weakref.ref(e.model.kv.k[0])
        running = e.add_request(PROMPTS[0], 6)
        e.step()
        e.add_request(PROMPTS[1], 6)
        ended = e.close()
        assert [(r.rid, r.state) for r in ended][0] == (running, RequestState.ABORTED)
        assert len(ended) == 2 and len(ended[0].output) >= 1 and ended[1].output == ()
        assert kv() is None and e.model.kv is None and not e.runner.graphs_enabled
        assert e.close() == [] and e.pending() is None
        for call in (lambda: e.generate(PROMPTS[:1], 2), e.step, lambda: e.add_request([1], 2),
                     e.release_memory_occupation, lambda: e.update_weights_from_tensors({})):
            with pytest.raises(RuntimeError, match=r"\(\) on a closed engine .*build a new engine"):
                call()
        with GenerationEngine(EngineConfig(max_kv_slots=512), model=e.model) as again:
            assert outputs_of(again) == reference
        assert again.model.kv is None
    finally:
        gc.enable()


# -- refused calls change nothing ------------------------------------------------------------------
def test_generate_while_asleep_is_refused_and_queues_nothing(empties):
    e = engine()
    e.release_memory_occupation()
    with pytest.raises(RuntimeError, match="asleep"):
        e.generate(PROMPTS[:2], 4)
    assert e.pending() is None and e.results == {}
    e.resume_memory_occupation()
    assert e.flush_cache().flushed  # not blocked by a leftover request
    e.release_memory_occupation()
    assert empties == [ReleasePoint.SLEEP, ReleasePoint.USER, ReleasePoint.SLEEP]


def test_malformed_prompts_fail_alone_with_a_clear_message(reference):
    e = engine()
    batch = [PROMPTS[0], None, PROMPTS[1], 5, torch.tensor([1, 2]), [1, 2.0], "abc", PROMPTS[2]]
    results = e.generate(batch, 6)
    assert [r.state for r in results] == [
        RequestState.FINISHED, RequestState.FAILED, RequestState.FINISHED, RequestState.FAILED,
        RequestState.FAILED, RequestState.FAILED, RequestState.FAILED, RequestState.FINISHED,
    ]
    assert [results[i].output for i in (0, 2, 7)] == reference[:3]
    assert "prompt None is a NoneType" in results[1].error and "list of int token ids" in results[1].error
    assert "prompt 5 is a int" in results[3].error
    assert "torch.Tensor" in results[4].error and "tolist()" in results[4].error
    assert "token 2.0 at position 1 is a float" in results[5].error
    assert "str" in results[6].error
    assert e.pending() is None and e.results == {} and e.blocks.available == e.blocks.num_blocks


def test_add_request_refuses_malformed_prompts_with_type_errors():
    e = engine()
    for bad in (None, 7, torch.tensor([1]), [1, None]):
        with pytest.raises(TypeError, match="int token id"):
            e.add_request(bad, 3)
    assert e.pending() is None


def test_a_generate_whose_step_raises_leaves_nothing_behind(monkeypatch, reference):
    e = engine()
    fail_once(monkeypatch, e.runner, "forward", RuntimeError("simulated kernel failure"))
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        e.generate(PROMPTS, 6)
    assert e.pending() is None and e.results == {} and e.blocks.available == e.blocks.num_blocks
    assert outputs_of(e) == reference


# -- no autograd in inference paths -------------------------------------------------------------------
@pytest.mark.parametrize("runner", ["eager", "graph_runner_fallback", "graph_runner_emulated"])
def test_nothing_the_engine_runs_records_autograd_history(monkeypatch, runner):
    factories = {
        "eager": None,
        "graph_runner_fallback": lambda e: GraphRunner(e.model, e.platform, e.device_index,
                                                       hidden_size=e.model.config.hidden_size, dtype=e.config.dtype),
        "graph_runner_emulated": lambda e: GraphRunner(e.model, e.platform, e.device_index,
                                                       hidden_size=e.model.config.hidden_size, dtype=e.config.dtype,
                                                       buckets=(16,), emulate=True),
    }
    e = GenerationEngine(EngineConfig(max_kv_slots=512), runner_factory=factories[runner])
    seen = []
    real_forward, real_logits = e.runner.forward, e.model.logits

    def forward(ids, meta, rows):
        hidden = real_forward(ids, meta, rows)
        seen.append(("hidden", hidden.requires_grad, hidden.grad_fn is not None))
        return hidden

    def logits(hidden, index):
        out = real_logits(hidden, index)
        seen.append(("logits", out.requires_grad, out.grad_fn is not None))
        return out

    monkeypatch.setattr(e.runner, "forward", forward)
    monkeypatch.setattr(e.model, "logits", logits)
    e.generate(PROMPTS[:2], 3)
    assert seen and all(not tracked and not graph for _, tracked, graph in seen), seen
    assert e.model.kv.k.grad_fn is None and not e.model.kv.k.requires_grad


@pytest.mark.parametrize("where", ["wait", "launch"])
def test_oom_while_a_decode_window_lands_or_chains_is_handled_like_oom_in_a_step(empties, where):
    from torchhal.core.engine import DecodeGraphConfig

    graphs = DecodeGraphConfig(batch_buckets=(1, 2, 4), context_buckets=(64, 128), steps_per_sync=4, emulate=True)
    expected = outputs_of(engine(decode_graphs=graphs), PROMPTS[:2], 20)
    e = engine(decode_graphs=graphs)
    rids = [e.add_request(p, 20) for p in PROMPTS[:2]]
    e.step()  # the prefill
    e.step()  # a decode window launched: its tokens land at the next step
    assert e.executor.in_flight is not None
    runner = e.decode_runner if where == "launch" else e.executor
    real = getattr(runner, where)
    failed = []

    def out_of_memory_once(*args, **kwargs):
        if not failed and (where == "wait" or kwargs.get("chained")):
            failed.append(True)
            raise torch.OutOfMemoryError(f"simulated: decode window {where}")
        return real(*args, **kwargs)

    setattr(runner, where, out_of_memory_once)
    assert e.step() == []  # not raised: the batch is retracted and prefills again
    assert failed and empties == [ReleasePoint.OOM]
    while any(rid not in e.results for rid in rids):
        e.step()
    assert [e.results[rid].output for rid in rids] == expected
    assert e.blocks.available == e.blocks.num_blocks
