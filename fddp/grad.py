"""``grad`` and ``grad_and_value``: torch.func's gradient transforms, averaged over the ranks.

Each bucket's all-reduce starts from inside the backward pass, as soon as that bucket's gradient
exists, and is waited on only at the end, so communication overlaps the rest of the backward pass
(as torch DDP's does). The arithmetic is :class:`fddp.comm.Reducer`'s, the one ``ddp_step`` uses,
so ``fddp.grad(fn)(params, ...)`` equals ``fddp.ddp_step(params, torch.func.grad(fn)(params, ...))``
bit for bit.

How: autograd differentiates the caller's own leaves (no copy), and a hook on each leaf copies
its gradient, once backward has produced it, into its slice of the bucket's flat buffer, as torch
DDP's reducer does. When a bucket's last leaf arrives, its all-reduce is launched. Buckets are
launched in plan order on every rank (a bucket that is ready early waits for its predecessors), so
ranks whose backward passes visit parameters in different orders still issue the same sequence of
collectives; buckets whose leaves got no gradient are completed with zeros after backward.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist

from fddp.buckets import BucketPlan, LeafSpec, _shape_templates, new_buffer, unflatten
from fddp.comm import Reducer, SyncInfo, checked_plan, sync_options, tree_leaves_with_paths
from fddp.compress import as_compressor, check_return_info
from fddp.runtime import require_initialized

__all__ = ["grad", "grad_and_value"]

ArgNums = int | tuple[int, ...]


def grad_and_value(
    fn: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    weight: float | torch.Tensor | None = None,
    compression: Any = None,
    compression_state: Any = None,
    check_finite: bool = False,
    return_info: bool = False,
) -> Callable[..., Any]:
    """Return a function computing the rank-averaged gradient of ``fn`` and ``fn``'s value.

    The signature and results are those of :func:`torch.func.grad_and_value`, except that the
    gradients are already averaged over the ranks of ``group``, exactly as
    ``fddp.ddp_step(args[argnums], torch.func.grad(fn, argnums)(*args), ...)`` averages them. The
    all-reduces overlap the backward pass: each bucket's starts as soon as its gradients exist.

    Every rank must call the returned function with trees of the same signature (checked once per
    signature; a difference raises :class:`fddp.MismatchError` on every rank). A differentiated
    leaf that ``fn`` does not use gets a zero gradient, and its bucket is still sent, so ranks that
    use different parameters do not hang.

    The returned gradients are views into one flat buffer per bucket. ``fn`` sees the caller's
    own leaves (detached, never copied). Differentiation uses :func:`torch.autograd.grad`, so ``fn``
    must be differentiable by autograd (as for :func:`torch.func.grad`), and this cannot be nested
    inside other ``torch.func`` transforms.

    Args:
        fn: the function to differentiate; it must return a scalar tensor (or ``(scalar, aux)``
            with ``has_aux``).
        argnums: which positional argument(s) to differentiate with respect to: an int, or a
            tuple of ints (the gradients are then a tuple of trees).
        has_aux: ``fn`` returns ``(loss, aux)``; ``aux`` is returned alongside, not differentiated.
        group: the process group to average over; ``None`` for the default group.
        bucket_cap_mb: the cap of each bucket, in MiB.
        first_bucket_mb: the cap of the first bucket, in MiB.
        weight: this rank's weight (its sample count): the gradients are then the weighted mean,
            as in :func:`fddp.ddp_step`.
        compression: ``"bf16"``/``"fp16"`` (or :class:`fddp.Cast`) to send buckets in half
            precision, or a :class:`fddp.PowerSGD`, as in :func:`fddp.ddp_step`.
        compression_state: PowerSGD's state (``PowerSGD.init(params)``, then the previous call's
            ``info.compression_state``); requires ``return_info``.
        check_finite: compute ``info.finite`` (requires ``return_info``).
        return_info: also return a :class:`fddp.SyncInfo`, as the last element.

    Returns:
        A function of ``fn``'s arguments returning ``(grads, value)``, where ``value`` is ``fn``'s
        output (``(loss, aux)`` with ``has_aux``), detached; with ``return_info``,
        ``(grads, value, info)``.

    Example:
        >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 1))
        >>> loss_fn = lambda p, x: apply_fn(p, x).pow(2).mean()
        >>> grads, loss = fddp.grad_and_value(loss_fn)(params, torch.randn(8, 4))
    """
    nums = _check_argnums(argnums, "grad_and_value")
    options = _options(weight, compression, compression_state, check_finite, return_info, "grad_and_value")

    @functools.wraps(fn)
    def grad_and_value_fn(*args: Any, **kwargs: Any) -> Any:
        grads, value, info = _grad_and_value(
            fn, nums, argnums, has_aux, args, kwargs, group, bucket_cap_mb, first_bucket_mb, options, "grad_and_value"
        )
        return (grads, value, info) if return_info else (grads, value)

    return grad_and_value_fn


def grad(
    fn: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    weight: float | torch.Tensor | None = None,
    compression: Any = None,
    compression_state: Any = None,
    check_finite: bool = False,
    return_info: bool = False,
) -> Callable[..., Any]:
    """Return a function computing the rank-averaged gradient of ``fn``, as :func:`torch.func.grad`.

    The same as :func:`grad_and_value` without the value: the returned function gives ``grads``,
    ``(grads, aux)`` with ``has_aux``, and appends a :class:`fddp.SyncInfo` with ``return_info``.

    Example:
        >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 1))
        >>> grads = fddp.grad(lambda p, x: apply_fn(p, x).pow(2).mean())(params, torch.randn(8, 4))
    """
    nums = _check_argnums(argnums, "grad")
    options = _options(weight, compression, compression_state, check_finite, return_info, "grad")

    @functools.wraps(fn)
    def grad_fn(*args: Any, **kwargs: Any) -> Any:
        grads, value, info = _grad_and_value(
            fn, nums, argnums, has_aux, args, kwargs, group, bucket_cap_mb, first_bucket_mb, options, "grad"
        )
        out = (grads, value[1]) if has_aux else (grads,)
        out += (info,) if return_info else ()
        return out if len(out) > 1 else out[0]

    return grad_fn


def _options(
    weight: Any, compression: Any, compression_state: Any, check_finite: bool, return_info: bool, what: str
) -> dict[str, Any]:
    """Check the sync options when the transform is built, not at its first call."""
    as_compressor(compression, what)  # raises on an unknown compression
    check_return_info(compression, return_info, what)
    return dict(weight=weight, compression=compression, compression_state=compression_state, check_finite=check_finite)


def _check_argnums(argnums: Any, what: str) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else argnums
    if (
        not isinstance(nums, tuple)
        or not nums
        or not all(isinstance(a, int) and not isinstance(a, bool) for a in nums)
        or len(set(nums)) != len(nums)
    ):
        raise TypeError(f"fddp.{what}: argnums must be an int or a non-empty tuple of distinct ints, got {argnums!r}")
    return nums


class _Buckets:
    """Collect leaf gradients into the plan's flat buffers and launch each bucket once it is full,
    always in plan order, so every rank issues the same sequence of collectives whatever order its
    backward pass produced the gradients in."""

    def __init__(self, reducer: Reducer, plan: BucketPlan) -> None:
        self.reducer, self.plan = reducer, plan
        self.where = _slots(plan)
        self.flats: list[torch.Tensor | None] = [None] * len(plan.buckets)
        self.views: list[list[torch.Tensor] | None] = [None] * len(plan.buckets)  # leaf-shaped, per bucket
        self.missing = [set(b.indices) for b in plan.buckets]
        self.next = 0
        prescale = reducer.prescale
        self.scale = None if prescale is None or prescale == 1.0 else prescale

    def _leaf_views(self, b: int) -> list[torch.Tensor]:
        """Bucket ``b``'s buffer (made on first use) as views shaped like its leaves."""
        views = self.views[b]
        if views is None:
            bucket = self.plan.buckets[b]
            self.flats[b] = flat = new_buffer(bucket.numel, bucket.dtype, bucket.device)
            self.views[b] = views = torch._C._nn.unflatten_dense_tensors(flat, _shape_templates(self.plan)[b])
        return views

    def arrive(self, leaf: int, g: torch.Tensor) -> None:
        b, k = self.where[leaf]
        view = self._leaf_views(b)[k]
        if self.scale is None:
            view.copy_(g)  # the one copy, as ddp_step's flatten
        else:
            torch.mul(g, self.scale, out=view)  # the copy, scaled by 1/n on the way
        missing = self.missing[b]
        missing.discard(leaf)
        if not missing and b == self.next:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self.next < len(self.flats) and not self.missing[self.next]:
            self.reducer.launch(self.next, self.flats[self.next], prescaled=self.reducer.prescale is not None)
            self.flats[self.next] = self.views[self.next] = None  # the reducer holds the buffer now
            self.next += 1

    def flush(self) -> None:
        """Complete with zeros the leaves that got no gradient (unused this step), then launch."""
        for b in range(self.next, len(self.flats)):
            for leaf in self.missing[b]:
                self._leaf_views(b)[self.where[leaf][1]].zero_()
            self.missing[b].clear()
        self._launch_ready()


@functools.lru_cache(maxsize=64)
def _slots(plan: BucketPlan) -> dict[int, tuple[int, int]]:
    """Map each leaf to (bucket, position in the bucket) in the plan's buffers."""
    return {leaf: (b, k) for b, bucket in enumerate(plan.buckets) for k, leaf in enumerate(bucket.indices)}


def _grad_and_value(
    fn: Callable[..., Any],
    nums: tuple[int, ...],
    argnums: ArgNums,
    has_aux: bool,
    args: tuple,
    kwargs: dict,
    group: dist.ProcessGroup | None,
    bucket_cap_mb: float,
    first_bucket_mb: float,
    options: dict,
    what: str,
) -> tuple[Any, Any, SyncInfo]:
    require_initialized(what)
    for a in nums:
        if not -len(args) <= a < len(args):
            raise ValueError(f"fddp.{what}: argnums {argnums!r} refers to argument {a}, but fn got {len(args)} positional arguments")
    tree = args[nums[0]] if isinstance(argnums, int) else tuple(args[a] for a in nums)
    paths, leaves, spec = tree_leaves_with_paths(tree, what)
    for path, t in zip(paths, leaves):
        if not (t.is_floating_point() or t.is_complex()):
            raise TypeError(f"fddp.{what}: can only differentiate floating-point leaves, but leaf {path!r} is {t.dtype}")
    specs = tuple(LeafSpec.of(t) for t in leaves)
    sig_options = sync_options(options["weight"], options["compression"], options["compression_state"], what)
    plan = checked_plan(tree, spec, paths, specs, group, what, bucket_cap_mb, first_bucket_mb, options=sig_options)

    inputs = [t.detach().requires_grad_() for t in leaves]
    reducer = Reducer(len(plan.buckets), group, what, plan=plan, **options)
    buckets = _Buckets(reducer, plan)
    for i, x in enumerate(inputs):
        # A leaf's hook sees its whole gradient: autograd sums every use of a tensor before the
        # tensor's hooks run.
        x.register_hook(functools.partial(buckets.arrive, i))
    views = optree.tree_unflatten(spec, inputs)
    call_args = list(args)
    if isinstance(argnums, int):
        call_args[nums[0]] = views
    else:
        for a, v in zip(nums, views):
            call_args[a] = v

    with torch.enable_grad():
        out = fn(*call_args, **kwargs)
        loss = _loss_of(out, has_aux, what)
        if loss.requires_grad:
            torch.autograd.grad(loss, inputs, allow_unused=True)
    buckets.flush()
    flats, info = reducer.finish()
    grads = optree.tree_unflatten(spec, unflatten(plan, flats))
    value = optree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    return grads, value, info


def _loss_of(out: Any, has_aux: bool, what: str) -> torch.Tensor:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"fddp.{what}(fn, has_aux=True): fn must return a (loss, aux) tuple, got {type(out).__name__}")
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"fddp.{what}: fn must return a scalar tensor (the loss), got {got}")
    return out
