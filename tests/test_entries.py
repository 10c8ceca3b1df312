"""One way in: every public function that communicates runs inside the call scope, and a failure on
one rank, before or after it sent anything, reaches every rank.

Three checks:

- the public API, walked: every public callable is either one that communicates, marked by
  ``fddp._dist.entry`` (or, for the transforms ``grad``/``grad_and_value``, the function they
  return), or one that never communicates; a new public name must be put in one of the two lists;
- the guard of ``tests/scopes.py`` (which every multi-process test of the suite runs under) can
  fail: a collective fddp issues outside any scope is caught;
- for each communicating entry, on 2 and 3 ranks, on a subgroup of its own: a rank that raises
  before it sends anything (a bad argument) -> its own error there, :class:`fddp.PeerError` on
  every peer within 5 s, and the subgroup still carries the next call; a rank that raises after
  it sent something (a failure injected at its second collective) -> an fddp error on every peer
  within 5 s; and the default group is untouched either way (a failure fails only the groups of
  the failing call).
"""

from __future__ import annotations

import inspect
import time

import pytest
import torch

import fddp
import fddp.diloco
import fddp.optim
import fddp.scaling
import fddp.zero
from dist import run

# Public callables that issue collectives (or must agree with their peers): each one's body is an
# fddp call scope by construction.
COMMUNICATING = {
    "fddp.broadcast",
    "fddp.psum",
    "fddp.pmean",
    "fddp.pmax",
    "fddp.all_gather",
    "fddp.reduce_scatter",
    "fddp.ddp_step",
    "fddp.sync_buffers",
    "fddp.verify_replicas",
    "fddp.zero.shard",
    "fddp.zero.gather",
    "fddp.zero.fully_shard",
    "fddp.zero.unshard",
    "fddp.zero.write_back",
    "fddp.zero.load_full",
    "fddp.checkpoint.save",
    "fddp.checkpoint.save_step",
    "fddp.checkpoint.load_step",
    "fddp.checkpoint.save_sharded",
    "fddp.checkpoint.load_sharded",
    "fddp.scaling.auto_bucket_cap",
    "fddp.scaling.verify_bucket_cap",
    "fddp.scaling.measure_link",
    "fddp.scaling.measure_timeline",
    "fddp.scaling.measure_bucket_cost",
}
# Transforms whose returned function is the entry.
TRANSFORMS = {"fddp.grad", "fddp.grad_and_value"}
# Public callables whose calls are entries by another construction, named with where their scope is.
SCOPED_ELSEWHERE = {
    "fddp.shutdown": "its agreement and barrier run in a call scope before the group is destroyed",
    "fddp.sync_batchnorm": "converts modules only; SyncBatchNorm's forward and backward communicate inside their scope",
    "fddp.zero.release": "frees gathered units; the collectives are write_back's",
    "fddp.checkpoint.load": "one rank's own read of a file: no peer waits for it",
    "fddp.diloco.diloco": "builds the outer step; DiLoCo.step is an entry (the table below fails it)",
    "fddp.diloco.local_sgd": "builds the outer step; DiLoCo.step is an entry (the table below fails it)",
    "fddp.init": "torch.distributed's own init_process_group: there is no group to scope before it",
    "fddp.optim.global_norm": "on shards, its one all-reduce is an entry (optim.global_norm); a replicated tree is local",
    "fddp.optim.clip_by_global_norm": "builds a transformation; its update on shards reaches global_norm's entry",
    "fddp.optim.apply_gradients": "local, but for a clip on shards: global_norm's entry; for muon on shards: optim.muon's",
    "fddp.optim.muon": "builds a transformation; its update on shards is the optim.muon entry (the table below fails it)",
    "fddp.optim.apply_if_finite": "chooses between trees locally; the optimizer it wraps judges shards by global_norm's entry",
    "fddp.apply_if_finite": "fddp.optim.apply_if_finite itself",
}
# Public callables that never communicate.
LOCAL = {
    "fddp.accumulate_grads", "fddp.checks", "fddp.clear_caches", "fddp.device",
    "fddp.functionalize", "fddp.functionalize_with_buffers", "fddp.is_initialized", "fddp.is_main", "fddp.load_into",
    "fddp.local_rank", "fddp.rank", "fddp.set_checks", "fddp.world_size",
    "fddp.checkpoint.latest", "fddp.checkpoint.steps", "fddp.checkpoint.step_path",
    "fddp.scaling.predict_step", "fddp.scaling.choose_bucket_cap", "fddp.scaling.wire_rounds", "fddp.scaling.fit_alpha_beta",
    "fddp.optim.fast_path", "fddp.optim.apply_updates", "fddp.optim.chain", "fddp.optim.sgd", "fddp.optim.adam",
    "fddp.optim.adamw", "fddp.optim.multi_transform", "fddp.optim.masked", "fddp.optim.set_to_zero", "fddp.optim.by_path",
    "fddp.optim.inject_hyperparams", "fddp.optim.set_hyperparams", "fddp.optim.accumulate", "fddp.optim.constant",
    "fddp.optim.linear", "fddp.optim.cosine_decay", "fddp.optim.warmup_cosine_decay", "fddp.optim.exponential_decay",
    # optax's building blocks and schedules (elementwise, or a function of the step count)
    "fddp.optim.identity", "fddp.optim.scale", "fddp.optim.scale_by_schedule", "fddp.optim.scale_by_learning_rate",
    "fddp.optim.add_decayed_weights", "fddp.optim.trace", "fddp.optim.ema", "fddp.optim.scale_by_adam", "fddp.optim.scale_by_amsgrad",
    "fddp.optim.scale_by_rms", "fddp.optim.scale_by_stddev", "fddp.optim.zero_nans", "fddp.optim.clip",
    "fddp.optim.constant_schedule", "fddp.optim.linear_schedule", "fddp.optim.polynomial_schedule", "fddp.optim.cosine_decay_schedule",
    "fddp.optim.warmup_constant_schedule", "fddp.optim.warmup_cosine_decay_schedule", "fddp.optim.warmup_exponential_decay_schedule",
    "fddp.optim.join_schedules", "fddp.optim.piecewise_constant_schedule",
}  # fmt: skip
# Issue 54's optimizers (fddp/optim/_trust_ratio.py and neighbours).
SCOPED_ELSEWHERE.update({
    name: "builds a transformation; on shards its per-leaf norms are one all-reduce, the optim.trust_ratio entry"
    for name in ("fddp.optim.lamb", "fddp.optim.lars", "fddp.optim.scale_by_trust_ratio")
})  # fmt: skip
LOCAL |= {
    "fddp.optim.rmsprop", "fddp.optim.adagrad", "fddp.optim.nadam", "fddp.optim.radam", "fddp.optim.adafactor",
    "fddp.optim.lion", "fddp.optim.scale_by_lion", "fddp.optim.scale_by_radam", "fddp.optim.scale_by_factored_rms",
}  # fmt: skip
MODULES = (fddp, fddp.zero, fddp.checkpoint, fddp.diloco, fddp.scaling, fddp.optim)


def _public_functions() -> dict[str, object]:
    out = {}
    for module in MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj) or (callable(obj) and not inspect.isclass(obj) and not inspect.ismodule(obj)):
                out[f"{module.__name__}.{name}"] = obj
    return out


def test_every_public_function_is_classified_and_every_communicating_one_is_an_entry():
    functions = _public_functions()
    known = COMMUNICATING | TRANSFORMS | set(SCOPED_ELSEWHERE) | LOCAL
    unclassified = sorted(set(functions) - known)
    assert not unclassified, f"classify these public functions in tests/test_entries.py (communicate or not): {unclassified}"
    for name in COMMUNICATING:
        assert getattr(functions[name], "__fddp_entry__", None), f"{name} communicates but is not decorated with fddp._dist.entry"
    params = {"w": torch.zeros(2)}
    for name in TRANSFORMS:
        fn = functions[name](lambda p: (p["w"] ** 2).sum())
        assert getattr(fn, "__fddp_entry__", None), f"the function {name} returns is not an fddp call scope"
    del params


def _unscoped_worker() -> str:
    import scopes
    from fddp.sync._comm import Comm

    fddp.broadcast({"w": torch.zeros(2)})  # scoped: passes the guard
    plan = fddp.sync.plan_of({"w": torch.zeros(2)})
    try:
        Comm(None, "test", plan).all_reduce(torch.zeros(2))  # fddp's code, outside any scope
    except scopes.UnscopedCollective as e:
        return str(e)
    return "not caught"


def test_the_scope_guard_catches_an_unscoped_collective():
    message, _ = run(_unscoped_worker, 2)
    assert "fddp/sync/_comm.py" in message and "outside any fddp call scope" in message, message


# --- the failure table -----------------------------------------------------------------------------


class Injected(RuntimeError):
    """The failure injected after a rank sent something."""


def _fail_after(n: int) -> None:
    """On this rank, raise :class:`Injected` at the ``n``-th collective fddp issues from now on."""
    import torch.distributed as dist

    count = [0]
    originals = {}

    def wrap(name, fn):
        def failing(*args, **kwargs):
            import scopes

            if scopes._caller() is not None:
                count[0] += 1
                if count[0] == n:
                    _restore()
                    raise Injected(f"injected at fddp's collective {n} (torch.distributed.{name})")
            return fn(*args, **kwargs)

        return failing

    def _restore():
        for name, fn in originals.items():
            setattr(dist, name, fn)

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_to_all_single", "barrier"):
        originals[name] = getattr(dist, name)
        setattr(dist, name, wrap(name, originals[name]))
    _fail_after.restore = _restore  # type: ignore[attr-defined]


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _case(name: str, group, bad: bool, directory: str = ""):
    """Run entry ``name`` on ``group`` (with a bad argument on this rank if ``bad``); ``directory``
    is one the ranks share, for checkpoints."""
    params = {"w": torch.ones(4), "b": torch.zeros(3)}
    if name == "ddp_step":
        return fddp.ddp_step(params, {"w": torch.ones(3)} if bad else params, group=group)
    if name == "grad_and_value":
        def loss(p, x):
            if bad:
                raise ValueError("a bad batch on this rank")
            return sum((v * x).sum() for v in p.values())
        return fddp.grad_and_value(loss, group=group)(params, torch.tensor(2.0))
    if name == "broadcast":
        return fddp.broadcast(params, src=7 if bad else 0, group=group)
    if name == "psum":  # the path every collective of fddp.sync._lax shares
        return fddp.psum({"w": 1.0} if bad else params, group=group)
    if name == "sync_buffers":
        return fddp.sync_buffers(params, "average" if bad else "mean", group=group)
    if name == "verify_replicas":
        return fddp.verify_replicas({"w": "not a tensor"} if bad else params, group=group)
    if name == "zero.shard":
        return fddp.zero.shard(params, group=group, bucket_cap_mb=-1.0 if bad else 25.0)
    if name == "zero.gather":
        shards = fddp.zero.shard(params, group=group)
        if bad:
            shards = type(shards)([t[:0] for t in shards.shards], shards.layout)  # shards of another size
        return fddp.zero.gather(shards).wait()
    if name == "fully_shard":
        apply_fn, shards = fddp.zero.fully_shard(_mlp(), group=group, min_unit_mb=0)
        return apply_fn(params if bad else shards, torch.ones(3, 4)).sum()  # params: not the shards it needs
    if name == "scaling.measure_link":
        return fddp.scaling.measure_link(group=group, sizes=(2**6, 2**8), repeats=0 if bad else 1)
    if name == "zero.unshard":
        apply_fn, shards = fddp.zero.fully_shard(_mlp(), group=group, min_unit_mb=0)
        return fddp.zero.unshard(shards, invariant="yes" if bad else False)
    if name == "zero.load_full":
        model = _mlp()
        apply_fn, shards = fddp.zero.fully_shard(model, group=group, min_unit_mb=0)
        source = {k: v.detach() + 1 for k, v in _mlp().named_parameters()}
        if bad:
            source.pop("0.weight")  # this rank's copy of the weights lacks a key
        return fddp.zero.load_full(shards, source)
    if name == "zero.write_back":
        apply_fn, shards = fddp.zero.fully_shard(_mlp(), group=group, min_unit_mb=0)
        return fddp.zero.write_back(apply_fn, shards, rank=99 if bad else None)
    _case.calls += 1  # type: ignore[attr-defined]  # a new checkpoint each call
    if name == "checkpoint.save_step":
        return fddp.checkpoint.save_step(directory + "/steps", _case.calls, params, keep=0 if bad else 2, group=group)
    if name == "checkpoint.Manager.step":
        with fddp.checkpoint.Manager(f"{directory}/manager{_case.calls}", every=1, group=group, signals=()) as manager:
            return manager.step(-1 if bad else 1, params)  # a negative step on one rank
    if name == "checkpoint.save_sharded":
        shards = fddp.zero.shard(params, group=group)  # every rank, before the call under test
        tree = {"w": object()} if bad else shards  # a leaf no checkpoint can store
        return fddp.checkpoint.save_sharded(f"{directory}/sharded{_case.calls}", tree, group=group)
    if name == "SyncBatchNorm":
        bn = fddp.SyncBatchNorm(3, group=group)
        return bn(torch.ones(4) if bad else torch.randn(4, 3))  # 1-D: not a batch
    if name == "optim.muon":
        params = {"a": torch.ones(8, 8), "b": torch.zeros(3)}  # the matrix's group steps first
        shards = fddp.zero.shard(params, group=group, bucket_cap_mb=0.0001, first_bucket_mb=0.0001)
        opt = fddp.optim.muon(0.02, fallback=fddp.optim.sgd(0.1))
        return opt.update(shards, opt.init(shards), None if bad else shards)  # weight decay needs the parameters
    if name == "diloco.step":
        outer = fddp.diloco.diloco(every=1, group=group)
        state = outer.init(params)
        return outer.step(params, state, weight=-1.0 if bad else 1.0)  # a negative sample count on one rank
    raise AssertionError(name)


_case.calls = 0  # type: ignore[attr-defined]

ENTRIES = ("ddp_step", "grad_and_value", "broadcast", "psum", "sync_buffers", "verify_replicas", "zero.shard", "zero.gather",
           "fully_shard", "zero.unshard", "zero.load_full", "zero.write_back", "checkpoint.save_step",
           "checkpoint.Manager.step", "checkpoint.save_sharded", "SyncBatchNorm", "diloco.step", "scaling.measure_link",
           "optim.muon")  # fmt: skip


def _table_worker(mode: str, directory: str) -> list[tuple]:
    """Every entry on a subgroup of its own: the last rank fails ``mode`` ("before" or "after")."""
    import torch.distributed as dist

    me, world = fddp.rank(), fddp.world_size()
    failing = me == world - 1
    out = []
    for name in ENTRIES:
        group = dist.new_group(list(range(world)))
        _case(name, group, bad=False, directory=directory)  # the tree is known: the call under test repeats it (its buckets may go early)
        fddp.broadcast({"sync": torch.zeros(1)})  # all ranks start the case together (on the default group)
        if failing and mode == "after":
            _fail_after(2)
        t0 = time.monotonic()
        error = None
        try:
            _case(name, group, bad=failing and mode == "before", directory=directory)
            if not failing or mode == "after":
                fddp.broadcast({"probe": torch.zeros(1)}, group=group)  # a peer that finished learns at its next call
        except Exception as e:  # noqa: BLE001 - the table compares the ranks' errors
            error = type(e).__name__
        elapsed = time.monotonic() - t0
        if failing and mode == "after":
            _fail_after.restore()
        usable = None
        if mode == "before":
            fddp.broadcast({"after": torch.ones(1)}, group=group)  # the subgroup still carries calls
            usable = True
        fddp.broadcast({"world": torch.ones(1)})  # the default group is untouched
        out.append((name, error, elapsed, usable))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["before", "after"])
def test_a_failure_in_any_entry_reaches_every_rank_within_five_seconds(mode, world, tmp_path):
    results = run(_table_worker, world, mode, str(tmp_path), timeout=300)
    failing = results[-1]
    for r, rows in enumerate(results[:-1]):
        for (name, error, elapsed, usable), (_, own, own_elapsed, _) in zip(rows, failing):
            assert own is not None, (name, "the failing rank did not fail")
            if mode == "before":
                assert own != "Injected" and own not in ("PeerError", "MismatchError"), (name, own)
                assert error == "PeerError", (name, r, error)
                assert usable, (name, r)
            else:
                assert own == "Injected", (name, own)
                assert error in ("PeerError", "MismatchError"), (name, r, error)
            assert elapsed < own_elapsed + 5.0, (name, r, elapsed, own_elapsed)
