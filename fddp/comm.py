"""Collectives over bucket buffers, and the cross-rank signature check that guards them.

Every function here takes ``group`` (a torch.distributed process group, ``None`` for the default
one), launches one collective per bucket asynchronously and waits at the end, so buckets travel
back to back.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple, Sequence

import optree
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from fddp.buckets import BucketPlan, LeafSpec, definition_order, flatten, make_plan, unflatten
from fddp.compress import PowerSGD, PowerSGDStep, advance, as_compressor, check_state, signature_option
from fddp.runtime import require_initialized

__all__ = ["MismatchError", "SyncInfo", "Reducer", "check_signature", "tree_leaves_with_paths", "broadcast"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class MismatchError(RuntimeError):
    """Ranks disagree on a tree (structure, leaf paths, shapes, dtypes or devices).

    Raised on every rank of the group, with the same message, before any bucket is sent: the
    alternative is a hang or a silent mix of unrelated values.
    """


def path_str(path: tuple[Any, ...]) -> str:
    """Format an optree path as ``a/b/0``: the key a user sees in their dict of parameters."""
    return "/".join(str(k) for k in path) if path else "<root>"


def tree_leaves_with_paths(tree: Any, what: str) -> tuple[list[str], list[torch.Tensor], Any]:
    """Flatten a tree whose leaves must all be tensors; name the first leaf that is not."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"fddp.{what}: every leaf must be a torch.Tensor, but leaf {path_str(path)!r} is "
                f"{type(leaf).__name__}"
            )
    return [path_str(p) for p in paths], leaves, spec


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    # NCCL-only groups cannot reduce CPU tensors; mixed "cpu:gloo,cuda:nccl" groups can.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group_key(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else id(group)


_checked: set[tuple[Any, int]] = set()
_calls: dict[str, int] = {}  # calls per public function in this process, named in timeout errors


def _signature(spec: Any, paths: Sequence[str], specs: Sequence[LeafSpec]) -> list[tuple[str, str]]:
    # Device *type* only: cuda:0 on one rank and cuda:1 on another is the normal case.
    rows = [("<tree structure>", str(spec))]
    rows += [(p, f"shape={tuple(s.shape)} dtype={s.dtype} device={s.device.type}") for p, s in zip(paths, specs)]
    return rows


def _digest(rows: list[tuple[str, str]]) -> int:
    h = hashlib.blake2b(repr(rows).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True) >> 1  # keep -digest representable in int64


def check_signature(
    spec: Any,
    paths: Sequence[str],
    specs: Sequence[LeafSpec],
    group: dist.ProcessGroup | None,
    what: str,
    *,
    options: str = "",
    order: tuple[int, ...] | None = None,
) -> None:
    """Raise :class:`MismatchError` on every rank unless all ranks hold the same tree signature.

    ``options`` describes call options that change what travels (e.g. whether a weight rides
    along); ``order`` is the leaf order the bucket plan follows. Both are part of the signature.

    One small all-reduce (max of the digest and of its negation) per new signature and group;
    signatures already checked are remembered, so steady-state steps pay nothing. Only on a
    mismatch do the ranks gather their full signatures, to name the first differing leaf.

    The check catches ranks that build different trees (different models, code or dtypes). It
    cannot catch one rank switching, mid-run, to a tree it has not used before while its peers
    keep a tree they already checked: their caches then disagree on whether to check, and only a
    collective on every step could tell. That would cost what this design saves.

    Every synchronising call starts here, so this also numbers the calls to ``fddp.<what>`` in
    this process, for the error :func:`wait` raises ("call 1234 to fddp.ddp_step").
    """
    if torch.compiler.is_compiling():
        # Dynamo cannot trace the cache or the digest; a compiled step relies on its guards (a new
        # tree re-traces) and on an eager call (fddp.broadcast, a first eager step) having checked.
        return
    _calls[what] = _calls.get(what, 0) + 1
    key = (spec, tuple(specs), _group_key(group), options, order)
    if key in _checked:
        return
    rows = _signature(spec, paths, specs)
    if options:
        rows.append(("<options>", options))
    if order is not None:
        rows.append(("<leaf order>", ", ".join(paths[i] for i in order)))
    d = _digest(rows)
    t = torch.tensor([d, -d], dtype=torch.int64, device=_collective_device(group))
    wait(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True), what, "signature check")
    if t[0].item() == -t[1].item():
        _checked.add(key)
        return
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, rows, group=group)
    raise MismatchError(f"fddp.{what}: ranks hold different trees. {_first_difference(gathered)}")


def sync_options(weight: Any, compression: Any, compression_state: Any, what: str) -> str:
    """Describe the sync options that change what travels, for :func:`check_signature`.

    A weight makes bucket 0 one element longer, and compression changes every bucket: ranks that
    disagree on either must not reach the buckets.
    """
    weighted = "weight=given" if weight is not None else "weight=none"
    return f"{weighted} {signature_option(compression, compression_state, what)}"


def checked_plan(
    tree: Any,
    spec: Any,
    paths: Sequence[str],
    specs: tuple[LeafSpec, ...],
    group: dist.ProcessGroup | None,
    what: str,
    bucket_cap_mb: float,
    first_bucket_mb: float,
    *,
    options: str = "",
) -> BucketPlan:
    """Check ``tree``'s signature across the group (leaf order and ``options`` included), then
    return its bucket plan: the start of every bucketed collective."""
    order = definition_order(tree)
    check_signature(spec, paths, specs, group, what, options=options, order=order)
    return make_plan(specs, bucket_cap_mb, first_bucket_mb, order)


def _first_difference(per_rank: list[list[tuple[str, str]]]) -> str:
    ref = per_rank[0]
    for r, rows in enumerate(per_rank[1:], start=1):
        for i in range(max(len(ref), len(rows))):
            a = ref[i] if i < len(ref) else ("<missing>", "<no leaf>")
            b = rows[i] if i < len(rows) else ("<missing>", "<no leaf>")
            if a != b:
                if a[0] == b[0]:
                    return f"First difference at leaf {a[0]!r}: rank 0 has {a[1]}, rank {r} has {b[1]}."
                return f"First difference at leaf #{i}: rank 0 has {a[0]!r} ({a[1]}), rank {r} has {b[0]!r} ({b[1]})."
    return "The signatures hash differently but compare equal."  # pragma: no cover


def wait(work: Any, what: str, doing: str) -> None:
    """Wait for an async collective; on failure say which rank, which call and what it was doing."""
    try:
        work.wait()
    except Exception as e:  # gloo/NCCL raise RuntimeError (or DistBackendError) on timeout
        r, w = dist.get_rank(), dist.get_world_size()
        n = _calls.get(what)
        call = f" (call {n} to fddp.{what} in this process)" if n else ""
        verb = "timed out" if "timed out" in str(e).lower() else "failed"
        raise RuntimeError(
            f"fddp.{what}: rank {r} of {w} {verb} during {doing}{call}: {e}. A peer may have crashed, "
            "be stuck, or have skipped or reordered this call (every rank must make the same fddp "
            "calls in the same order); the process group's timeout (fddp.init(timeout=...)) bounds "
            "the wait."
        ) from e


class SyncInfo(NamedTuple):
    """What one synchronisation did, returned by ``ddp_step(..., return_info=True)``.

    Attributes:
        finite: with ``check_finite=True``, a bool tensor, True when every reduced gradient is
            finite. The reduced buffers are bitwise identical on all ranks, so every rank reaches
            the same verdict without another collective. ``None`` otherwise.
        weight: with ``weight=``, the sum of the weights over the ranks (a float64 tensor).
        bytes_sent: bytes this rank handed to collectives (the payload, before the backend's own
            ring or tree traffic).
        collectives: the number of collectives issued.
        compression_state: with a stateful compressor (:class:`fddp.PowerSGD`), its state after
            this step, to pass as ``compression_state=`` next time; ``None`` otherwise.

    Example:
        >>> grads, info = fddp.ddp_step(params, grads, check_finite=True, return_info=True)
        >>> skip = not info.finite  # the same verdict on every rank
    """

    finite: torch.Tensor | None
    weight: torch.Tensor | None
    bytes_sent: int
    collectives: int
    compression_state: Any = None


class Reducer:
    """Average one tree's bucket buffers over a group: launch each bucket as it is ready, then finish.

    ``ddp_step`` launches every bucket at once; ``fddp.grad_and_value`` launches each from inside
    the backward pass as soon as its gradients exist. Both then call :meth:`finish`, so the two
    paths share every numeric choice made here.

    Args:
        num_buckets: how many buckets will be launched.
        group: the process group.
        what: the public function's name, for error messages.
        weight: this rank's weight (e.g. its number of samples). The result is then
            ``sum_r w_r g_r / sum_r w_r``, and ``sum_r w_r`` travels in bucket 0's all-reduce; a
            half-precision bucket needs it before it is sent (so that it carries ``w_r / W * g_r``,
            which cannot overflow), and then it travels first, alone, in float64.
        compression: ``None``, ``"bf16"``, ``"fp16"``, a :class:`fddp.Cast` or a :class:`fddp.PowerSGD`.
        check_finite: compute :attr:`SyncInfo.finite`.
        compression_state: PowerSGD's state (from ``PowerSGD.init``); its successor is returned
            in :attr:`SyncInfo.compression_state`.
        plan: the bucket plan the buffers follow; PowerSGD needs it to see the leaves in a bucket.
    """

    def __init__(
        self,
        num_buckets: int,
        group: dist.ProcessGroup | None,
        what: str,
        *,
        weight: float | torch.Tensor | None = None,
        compression: Any = None,
        check_finite: bool = False,
        compression_state: Any = None,
        plan: BucketPlan | None = None,
    ) -> None:
        compressor = as_compressor(compression, what)
        self.group, self.what, self.check_finite = group, what, check_finite
        self.n = dist.get_world_size(group)
        self.comm_dtype = None if compressor is None or isinstance(compressor, PowerSGD) else compressor.dtype
        self.weight = None if weight is None else _as_weight(weight, what)
        # Plain sums over a power-of-two group are scaled by 1/n before they are sent, as torch DDP
        # does for every group size: 2**-k commutes with rounding, so sum(g_r / n) is exactly
        # sum(g_r) / n (short of subnormals), and a caller copying gradients into a bucket anyway
        # can scale in that copy (launch(prescaled=True)), which saves a pass after the wait.
        self.prescale = 1.0 / self.n if compressor is None and weight is None and self.n & (self.n - 1) == 0 else None
        self.sent: list[torch.Tensor | None] = [None] * num_buckets
        self.dtypes: list[torch.dtype | None] = [None] * num_buckets
        self.works: list[Any] = []
        self.weight_buf: torch.Tensor | None = None
        self.weight_work = -1  # index in works of the all-reduce that carries the weight
        self.wsum: torch.Tensor | None = None  # sum_r w_r, once known
        self.normalised = [False] * num_buckets  # buckets sent as w_r / W * g_r: no division after
        self.bytes_sent = 0
        self.collectives = 0
        # PowerSGD: `powersgd` drives the compressed steps; before start_iter the buckets take
        # the plain path and only the state's step count moves.
        self.powersgd: PowerSGDStep | None = None
        self.new_state: Any = None
        if isinstance(compressor, PowerSGD):
            self._start_powersgd(compressor, compression_state, plan, num_buckets)
        elif compression_state is not None:
            raise ValueError(f"fddp.{what}: compression_state is only used with compression=fddp.PowerSGD(...), got compression={compression!r}")

    def _start_powersgd(self, config: PowerSGD, state: Any, plan: BucketPlan | None, num_buckets: int) -> None:
        if self.weight is not None:
            raise ValueError(f"fddp.{self.what}: weight= cannot be combined with PowerSGD compression")
        if plan is None or len(plan.buckets) != num_buckets:
            raise ValueError(f"fddp.{self.what}: PowerSGD needs the bucket plan of the {num_buckets} buckets (plan=)")
        state = check_state(config, state, self.what)
        if int(state.step) < config.start_iter:
            self.new_state = advance(state)
        else:
            self.powersgd = PowerSGDStep(config, state, plan, self.n, self.what)

    def launch(self, i: int, flat: torch.Tensor, prescaled: bool = False) -> None:
        """Start bucket ``i``'s all-reduce. ``flat`` is this rank's buffer; it may be reused in place.

        ``prescaled``: ``flat`` already holds ``g * self.prescale`` (only when that is not None).
        """
        self.dtypes[i] = flat.dtype
        if self.prescale is not None:
            if not prescaled and self.prescale != 1.0:
                flat.mul_(self.prescale)
            self.sent[i] = flat
            self._issue(flat)
            return
        if self.powersgd is not None:
            self.powersgd.launch(i, flat, self._start)
            return
        comm_dtype = self.comm_dtype or flat.dtype
        # Low precision: divide before the sum, which could overflow where the mean does not.
        low = comm_dtype in _LOW_PRECISION
        if self.weight is not None and low:
            # w_r * g_r / n overflows fp16 where the mean does not (w_r is a sample count, often in the
            # thousands): learn W = sum_r w_r first, then send w_r / W * g_r, scaled before any cast
            # (one rounding) by a float64 CPU scalar (kept exact inside the kernel). Its sum is the mean.
            flat.mul_(self.weight / self._global_weight(flat.device).clamp_min(torch.finfo(torch.float64).tiny))
            self.normalised[i] = True
        if comm_dtype != flat.dtype:
            flat = flat.to(comm_dtype)
        if self.weight is not None:
            if i == 0 and not low:
                # The weight rides in bucket 0's all-reduce: one extra element, no extra collective.
                buf = torch.empty(flat.numel() + 1, dtype=flat.dtype, device=flat.device)
                torch.mul(flat, self.weight.to(flat.dtype), out=buf[:-1])
                buf[-1] = self.weight
                self.weight_buf, self.weight_work, flat = buf, len(self.works), buf
            elif not low:
                flat.mul_(self.weight.to(flat.dtype))
            if self.weight == 0:
                # A rank with no data: its gradients may be NaN (a mean over nothing), and 0 * NaN is NaN.
                (flat[:-1] if flat is self.weight_buf else flat).zero_()
        elif low:
            flat.div_(self.n)
        self.sent[i] = flat
        self._issue(flat)

    def _global_weight(self, device: torch.device) -> torch.Tensor:
        """Return ``sum_r w_r`` as a float64 CPU scalar, waiting for the collective that carries it.

        Half-precision buckets need it before they are sent. If bucket 0 already carries the weight
        (a float bucket 0, a half-precision later one) that all-reduce is waited for; otherwise
        the weight travels alone, in float64, once per call.
        """
        if self.wsum is None:
            if self.weight_buf is None:
                # A copy: reshape/to alias the weight (the caller's tensor, even) on the same device.
                self.weight_buf, self.weight_work = self.weight.reshape(1).to(device, copy=True), len(self.works)
                self._issue(self.weight_buf)
            wait(self.works[self.weight_work], self.what, "the all-reduce of the weights")
            self.wsum = self.weight_buf[-1].to("cpu", torch.float64)
        return self.wsum

    def _issue(self, t: torch.Tensor) -> None:
        self.works.append(self._start(t))

    def _start(self, t: torch.Tensor) -> Any:
        """Start an all-reduce (sum) of ``t``, count it, and return its work handle."""
        self.bytes_sent += t.numel() * t.element_size()
        self.collectives += 1
        if torch.compiler.is_compiling():
            return _TracedAllReduce(t, self.group)
        return dist.all_reduce(t, group=self.group, async_op=True)

    def finish(self) -> tuple[list[torch.Tensor], SyncInfo]:
        """Wait for every bucket; return the mean buffers (in each bucket's own dtype) and the info."""
        if self.powersgd is not None:
            out, self.new_state = self.powersgd.finish(self._start, lambda work, doing: wait(work, self.what, doing))
            return out, self._info(out, None)
        for k, work in enumerate(self.works):
            wait(work, self.what, f"all-reduce {k + 1} of {len(self.works)}")
        wsum = None
        if self.weight is not None:
            if self.weight_buf is None:  # no buckets (an empty tree): the weight still has to travel
                self._global_weight(_collective_device(self.group))
            wsum = self.weight_buf[-1].to(torch.float64)
            # All ranks empty: every numerator is zero too, and the mean is taken as zero.
            denom = wsum.clamp_min(torch.finfo(torch.float64).tiny)
        out = []
        for i, (flat, dtype) in enumerate(zip(self.sent, self.dtypes)):
            if self.weight is not None and i == 0 and flat is self.weight_buf:
                flat = flat[:-1]
            low = flat.dtype in _LOW_PRECISION
            if flat.dtype != dtype:
                flat = flat.to(dtype)
            if self.normalised[i] or self.prescale is not None:
                pass
            elif wsum is not None:
                flat = flat.div_(denom.to(dtype))
            elif not low:
                flat = flat.div_(self.n)
            out.append(flat)
        return out, self._info(out, wsum)

    def _info(self, out: list[torch.Tensor], wsum: torch.Tensor | None) -> SyncInfo:
        finite = None
        if self.check_finite:
            finite = _all_finite(out)
        return SyncInfo(finite, wsum, self.bytes_sent, self.collectives, self.new_state)


def _all_finite(flats: list[torch.Tensor]) -> torch.Tensor:
    """Return a bool tensor: True when no buffer holds a NaN or an Inf.

    Each buffer's min and max come from one pass without a temporary (``aminmax`` propagates NaN,
    and an Inf is the min or the max); ``isfinite(f).all()`` writes a bool per element first and
    is ~15x slower on a 25 MB bucket on the CPU.
    """
    ends = [torch.stack(torch.aminmax(torch.view_as_real(f) if f.is_complex() else f)) for f in flats if f.numel()]
    if not ends:
        return torch.tensor(True)
    return torch.isfinite(torch.cat([e.to(ends[0].device) for e in ends])).all()


class _TracedAllReduce:
    """An all-reduce torch.compile puts in its graph (a functional collective); ``wait`` copies the
    result back into the input, the in-place contract of ``dist.all_reduce`` the callers rely on."""

    def __init__(self, t: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        self.t = t
        self.out = funcol.all_reduce(t, "sum", group if group is not None else dist.group.WORLD)

    def wait(self) -> None:
        self.t.copy_(funcol.wait_tensor(self.out))


def _as_weight(weight: float | torch.Tensor, what: str) -> torch.Tensor:
    w = torch.as_tensor(weight, dtype=torch.float64).detach().cpu()
    if w.numel() != 1:
        raise ValueError(f"fddp.{what}: weight must be a scalar (this rank's sample count), got shape {tuple(w.shape)}")
    return w.reshape(())


def broadcast(tree: Any, src: int = 0, group: dist.ProcessGroup | None = None, *, bucket_cap_mb: float = 25.0) -> Any:
    """Return ``tree`` with rank ``src``'s values on every rank, in a few fused broadcasts.

    The leaves are packed into flat buckets (the same planner as :func:`fddp.ddp_step`) and each
    bucket is broadcast with one collective. The input is not modified; the returned leaves are
    views into the received buffers. Before the first broadcast of a tree structure the ranks
    compare its signature and raise :class:`MismatchError` on any difference.

    Args:
        tree: a pytree of tensors (parameters, optimizer state, buffers).
        src: the rank, within ``group``, whose values everyone receives.
        group: the process group; ``None`` for the default one.
        bucket_cap_mb: the size of each fused broadcast, in MiB.

    Returns:
        A tree of the same structure holding ``src``'s values.

    Example:
        >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 2))
        >>> params = fddp.broadcast(params)  # every rank now starts from rank 0's initialisation
    """
    require_initialized("broadcast")
    paths, leaves, spec = tree_leaves_with_paths(tree, "broadcast")
    n = dist.get_world_size(group)
    if not 0 <= src < n:
        raise ValueError(f"fddp.broadcast: src must be a rank of the group, in [0, {n}), got {src}")
    specs = tuple(LeafSpec.of(t) for t in leaves)
    plan = checked_plan(tree, spec, paths, specs, group, "broadcast", bucket_cap_mb, bucket_cap_mb)
    flats = flatten(plan, [t.detach() for t in leaves])
    if n > 1:
        global_src = src if group is None else dist.get_global_rank(group, src)
        works = [dist.broadcast(f, src=global_src, group=group, async_op=True) for f in flats]
        for i, work in enumerate(works):
            wait(work, "broadcast", f"the broadcast of bucket {i} of {len(flats)}")
    return optree.tree_unflatten(spec, unflatten(plan, flats))
