"""``grad`` and ``grad_and_value``: torch.func's gradient transforms, averaged over the ranks.

Each bucket's collectives start from inside the backward pass, as soon as that bucket's gradient
exists, and are waited on only at the end, so communication overlaps the rest of the backward pass
(as torch DDP's does). The reducer and comm hook are the ones ``ddp_step`` uses, so
``fddp.grad(fn)(params, ...)`` equals ``fddp.ddp_step(params, torch.func.grad(fn)(params, ...))``
bit for bit.

How: autograd differentiates the caller's own leaves (no copy), and a hook on each leaf hands its
gradient, once backward has produced it, to the reducer, which copies it into its slice of the
bucket's flat buffer, as torch DDP's reducer does, and launches every bucket that is complete.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from typing import Any, Callable

import optree
import torch
import torch.distributed as dist
import torch.utils._pytree as torch_pytree

from fddp import _dist, _layout
from fddp._layout import BUCKET_CAP_MB, FIRST_BUCKET_MB
from fddp._tree import paths, tensor_leaves
from fddp.sync import _differentiable
from fddp.sync._accumulate import Window, window, window_value
from fddp.sync._reducer import SyncInfo
from fddp.sync._setup import KEYWORDS, SyncOptions, as_weight, check_dtypes, check_state, make_options, setup

__all__ = ["grad", "grad_and_value"]

ArgNums = int | tuple[int, ...]
_CALL_TIME = ("weight", "compression_state", "accumulated")  # per-step values, given to the transformed function
_BUILD_TIME = tuple(KEYWORDS)


def grad_and_value(
    fn: Callable[..., Any],
    argnums: ArgNums = 0,
    has_aux: bool = False,
    *,
    group: dist.ProcessGroup | None = None,
    bucket_cap_mb: float = BUCKET_CAP_MB,
    first_bucket_mb: float = FIRST_BUCKET_MB,
    compression: Any = None,
    check_finite: bool = False,
    return_info: bool = False,
) -> Callable[..., Any]:
    """Return a function computing the rank-averaged gradient of ``fn`` and ``fn``'s value.

    The signature and results are those of :func:`torch.func.grad_and_value`, except that the
    gradients are already averaged over the ranks of ``group``, exactly as
    ``fddp.ddp_step(args[argnums], torch.func.grad(fn, argnums)(*args), ...)`` averages them. The
    collectives overlap the backward pass: each bucket's starts as soon as its gradients exist.

    Build the transform once; values that change every step go to the returned function as
    keyword arguments, which it keeps for itself (``fn`` never sees them):

    - ``weight=``: this rank's weight (its sample count); the gradients are then the weighted
      mean, as with :func:`fddp.ddp_step`'s ``weight=``;
    - ``compression_state=``: a stateful comm hook's state (PowerSGD's), the previous call's
      ``info.compression_state``;
    - ``accumulated=``: a :class:`fddp.GradAccumulator` holding the earlier micro-batches of a
      gradient-accumulation window (summed locally with :func:`fddp.accumulate_grads`): this call
      is the window's last micro-batch, and the result is the window's mean gradient averaged over
      the ranks, reduced while this backward runs, as torch DDP's last backward after
      ``no_sync()`` reduces. It equals ``fddp.ddp_step(params, acc.mean())`` (with ``weight=``:
      ``fddp.ddp_step(params, acc.mean(), weight=acc.weight)``), ``acc`` the window with this
      micro-batch added, to the bit.

    Every rank must call the returned function with trees of the same signature (checked once per
    signature; a difference raises :class:`fddp.MismatchError` on every rank). A differentiated
    leaf that ``fn`` does not use gets a zero gradient, and its bucket is still sent, so ranks that
    use different parameters do not hang.

    The returned gradients are views into one flat buffer per bucket; on the CPU the transform
    also keeps its last call's raw gradients until its next call starts, as a module keeps
    ``.grad`` from one step to the next (glibc then reuses that memory instead of returning it to
    the OS and faulting it in again every step). ``fn`` sees the caller's
    own leaves (detached, never copied). Differentiation uses :func:`torch.autograd.grad`, so ``fn``
    must be differentiable by autograd (activation checkpointing works). Inside a torch.func
    transform (``vmap`` over an ensemble, ``jacrev``, ``hessian``) it falls back to
    ``torch.func.grad_and_value`` followed by the differentiable :func:`fddp.ddp_step`: the same
    buckets and mean, after backward rather than inside it.

    Args:
        fn: the function to differentiate; it must return a scalar tensor (or ``(scalar, aux)``
            with ``has_aux``).
        argnums: which positional argument(s) to differentiate with respect to: an int, or a
            tuple of ints (the gradients are then a tuple of trees).
        has_aux: ``fn`` returns ``(loss, aux)``; ``aux`` is returned alongside, not differentiated
            (its tensors detached, in any container torch.func knows, such as a transformers
            ``ModelOutput``).
        group: the process group to average over; ``None`` for the default group.
        bucket_cap_mb: the cap of each bucket, in MiB.
        first_bucket_mb: the cap of the first bucket, in MiB.
        compression: ``"bf16"``/``"fp16"`` (or :class:`fddp.Cast`), a :class:`fddp.PowerSGD` or any
            :class:`fddp.hooks.CommHook`, as in :func:`fddp.ddp_step`.
        check_finite: compute ``info.finite`` (requires ``return_info``).
        return_info: also return a :class:`fddp.SyncInfo`, as the last element.

    Returns:
        A function of ``fn``'s arguments (plus the keywords ``weight=`` and
        ``compression_state=``) returning ``(grads, value)``, where ``value`` is ``fn``'s output
        (``(loss, aux)`` with ``has_aux``), detached; with ``return_info``, ``(grads, value, info)``.

    Example:
        >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 1))
        >>> loss_fn = lambda p, x: apply_fn(p, x).pow(2).mean()
        >>> grads, loss = fddp.grad_and_value(loss_fn)(params, torch.randn(8, 4))
        >>> step = fddp.grad_and_value(loss_fn, return_info=True)  # built once, weighted per call
        >>> grads, loss, info = step(params, torch.randn(8, 4), weight=8)
    """
    transform = _Transform(
        fn, argnums, has_aux, "grad_and_value", group=group, bucket_cap_mb=bucket_cap_mb,
        first_bucket_mb=first_bucket_mb, compression=compression, check_finite=check_finite, return_info=return_info,
    )  # fmt: skip

    @functools.wraps(fn)
    def grad_and_value_fn(*args: Any, weight: Any = None, compression_state: Any = None, accumulated: Any = None, **kwargs: Any) -> Any:
        grads, value, info = transform(args, kwargs, weight, compression_state, accumulated)
        return (grads, value, info) if return_info else (grads, value)

    grad_and_value_fn.__fddp_entry__ = "grad_and_value"  # type: ignore[attr-defined]  # the transform's call scope
    return grad_and_value_fn


def grad(fn: Callable[..., Any], argnums: ArgNums = 0, has_aux: bool = False, **options: Any) -> Callable[..., Any]:
    """Return a function computing the rank-averaged gradient of ``fn``, as :func:`torch.func.grad`.

    The same as :func:`grad_and_value` without the value, with the same keyword options (``group``,
    ``bucket_cap_mb``, ``first_bucket_mb``, ``compression``, ``check_finite``, ``return_info``): the
    returned function gives ``grads``, ``(grads, aux)`` with ``has_aux``, and appends a
    :class:`fddp.SyncInfo` with ``return_info``. It takes the same per-call keywords, ``weight=``
    and ``compression_state=``.

    Example:
        >>> apply_fn, params = fddp.functionalize(torch.nn.Linear(4, 1))
        >>> grads = fddp.grad(lambda p, x: apply_fn(p, x).pow(2).mean())(params, torch.randn(8, 4))
    """
    transform = _Transform(fn, argnums, has_aux, "grad", **options)
    return_info = transform.return_info

    @functools.wraps(fn)
    def grad_fn(*args: Any, weight: Any = None, compression_state: Any = None, accumulated: Any = None, **kwargs: Any) -> Any:
        grads, value, info = transform(args, kwargs, weight, compression_state, accumulated)
        out = (grads, value[1]) if has_aux else (grads,)
        out += (info,) if return_info else ()
        return out if len(out) > 1 else out[0]

    grad_fn.__fddp_entry__ = "grad"  # type: ignore[attr-defined]  # the transform's call scope
    return grad_fn


class _Transform:
    """The part of ``grad``/``grad_and_value`` fixed when the transform is built."""

    def __init__(self, fn: Callable, argnums: Any, has_aux: bool, what: str, **options: Any) -> None:
        self.fn, self.argnums, self.has_aux, self.what = fn, argnums, has_aux, what
        self.nums = _check_argnums(argnums, what)
        self.tree_name = f"argument {self.nums[0]} (argnums={argnums!r})"  # for the message when it is a module
        _check_no_reserved_names(fn, what)
        unknown = sorted(set(options) - set(_BUILD_TIME))
        if unknown:
            per_call = [k for k in unknown if k in _CALL_TIME]
            hint = f" ({', '.join(per_call)} changes every step: pass it to the returned function)" if per_call else ""
            raise TypeError(f"fddp.{what}: unexpected keyword {unknown[0]!r}{hint}; the options are {', '.join(_BUILD_TIME)}")
        self.return_info = bool(options.get("return_info", False))
        self.compression = options.get("compression")
        # Options are checked when the transform is built, not at its first call; a weight given
        # at call time selects the weighted mean then.
        self.options = make_options(what, **options)
        # The previous call's raw gradients, kept until the next call starts (host memory only).
        # A module's .grad lives from one step to the next in the same way; freeing a whole step's
        # gradients at its end instead left glibc's heap top free, which glibc gives back to the OS
        # and the next step page-faults in again: about 1000 faults, 3 ms, a 15% longer step on
        # the benchmark MLP (benchmarks/step.py's floor). The memory is the peak's anyway.
        self.held: tuple | None = None
        self.weighted: SyncOptions | None = None  # the options with weight=, made at the first weighted call

    def call_options(self, weight: Any) -> SyncOptions:
        """The options of a call: the built ones, or their weighted twin (cached) for ``weight=``."""
        if weight is None:
            return self.options
        if self.weighted is None:
            o = self.options
            self.weighted = make_options(
                self.what, group=o.group, bucket_cap_mb=o.bucket_cap_mb, first_bucket_mb=o.first_bucket_mb,
                compression=self.compression, check_finite=o.check_finite, return_info=self.return_info, weighted=True,
            )  # fmt: skip
        return self.weighted

    def __call__(self, args: tuple, kwargs: dict, weight: Any, state: Any, accumulated: Any = None) -> tuple[Any, Any, SyncInfo]:
        # One fddp call on the group from the first check on: a rank whose arguments fail a check,
        # or whose fn raises, tells its peers (they raise fddp.PeerError at this call) instead of
        # leaving them waiting in its header.
        with _dist.call(self.options.group, self.what) as scope:
            return self._call(scope, args, kwargs, weight, state, accumulated)

    def _call(
        self, scope: _dist.call, args: tuple, kwargs: dict, weight: Any, state: Any, accumulated: Any
    ) -> tuple[Any, Any, SyncInfo]:
        what = self.what
        options = self.call_options(weight)
        w = None if weight is None else as_weight(weight, what)
        check_state(options, state, what, self.compression)
        nums = self.nums
        for a in nums:
            if not -len(args) <= a < len(args):
                raise ValueError(
                    f"fddp.{what}: argnums {self.argnums!r} refers to argument {a}, but fn got {len(args)} positional arguments"
                )
        tree = args[nums[0]] if isinstance(self.argnums, int) else tuple(args[a] for a in nums)
        flat = tensor_leaves(tree, what, name=self.tree_name)
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            # Inside torch.compile too: dynamo cannot trace the eager path (its hooks, the reducer),
            # and the differentiable ddp_step's traced mean is the reducer's arithmetic, bucket by bucket.
            return self._under_transforms(args, kwargs, tree, flat, options, w, state, accumulated)
        if _fully_sharded(flat[1], what):
            if accumulated is not None:
                raise TypeError(
                    f"fddp.{what}: accumulated= is for replicated parameters; fully sharded ones accumulate in "
                    "fddp.zero's own window (see docs/zero.md, Gradient accumulation)"
                )
            return self._fully_sharded(scope, args, kwargs, flat, options, state, weight)
        win = None
        if accumulated is not None:
            win = window(accumulated, flat[1], weight, what)
            w = None if weight is None else as_weight(win.weight, what)  # the whole window's weight
        leaves = flat[0]
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*leaves):
            for i, t in enumerate(leaves):
                if t.grad_fn is not None:
                    # Differentiating the caller's graph through this transform would need its
                    # derivative; detaching here would drop it without a word.
                    raise RuntimeError(
                        f"fddp.{what}: leaf {paths(flat[1])[i]!r} is the output of an autograd graph, "
                        "and differentiating through fddp.grad/grad_and_value is not supported; use "
                        "torch.func.grad and fddp.ddp_step, which compose, or detach the input"
                    )
        # Agreed after the forward pass: a rank whose fn raises has sent nothing, and announces
        # its failure in place of this call's header (fddp._dist.call).
        sync = setup(tree, options, what, state, weight=w, flat=flat, agree=False)
        if not all(b.dtype.is_floating_point or b.dtype.is_complex for b in sync.plan.buckets):  # per bucket, not per leaf
            i = next(i for i, t in enumerate(leaves) if not (t.is_floating_point() or t.is_complex()))
            raise TypeError(
                f"fddp.{what}: can only differentiate floating-point leaves, but leaf {paths(flat[1])[i]!r} is {leaves[i].dtype}"
            )
        check_dtypes(sync, what, self.compression)  # a complex leaf with compression='bf16'
        self.held = None  # freed before fn runs, as zero_grad(set_to_none=True) frees .grad
        inputs = [t.detach().requires_grad_() for t in leaves]
        reducer = sync.reducer(state)
        # A leaf's hook sees its whole gradient: autograd sums every use of a tensor before the
        # tensor's hooks run. With a window, the hook adds the earlier micro-batches first.
        arrive = reducer.arrive if win is None else functools.partial(_arrive_in_window, reducer, win)
        _hook_all(inputs, arrive)
        call_args = self.with_inputs(args, optree.tree_unflatten(sync.spec, inputs))
        with torch.enable_grad(), _caller_thread():  # fn's own backwards (a gradient penalty) too
            out = self.fn(*call_args, **kwargs)
            loss = _loss_of(out, self.has_aux, what)
            reducer.mark_backward()
            # Sent now and finished when backward has a bucket to send (or at the flush): a
            # rank whose peer is still in its forward pass goes on with its backward meanwhile.
            # A tree whose one bucket fits sends it in the head when backward has made it, and
            # the head is read at the end.
            sync.announce(replicas=True, drift=True, gate=reducer)
            if loss.requires_grad:
                raw = torch.autograd.grad(loss, inputs, allow_unused=True)
                if sync.plan.buckets and sync.plan.buckets[0].device.type == "cpu":
                    self.held = raw
        if win is not None:
            for i in reducer.unarrived():  # unused in this micro-batch: the earlier ones' mean
                if win.sums[i] is not None:
                    arrive(i, None)
        reducer.flush()
        flats, info = sync.close(reducer)  # a head that carried the data is read here, before anything is returned
        return sync.tree(flats, reducer.made_views(flats)), _detached(out), info

    def _under_transforms(
        self, args: tuple, kwargs: dict, tree: Any, flat: tuple, options: SyncOptions, w: Any, state: Any, accumulated: Any
    ) -> tuple[Any, Any, SyncInfo]:
        """Inside a torch.func transform (a vmapped ensemble, a hessian, per-sample gradients),
        where autograd's hooks cannot see the transform's levels, or inside ``torch.compile``, which
        cannot trace the eager path: ``torch.func.grad_and_value``, then the differentiable
        ``ddp_step`` (the same buckets, hook and mean, and JAX's ``lax.pmean`` rules under the
        outer transform). Fully sharded parameters need no sync:
        their gathers' backward averages them."""
        what = self.what
        if accumulated is not None:
            raise TypeError(
                f"fddp.{what}: accumulated= cannot be used inside a torch.func transform or torch.compile (its window's "
                "sums are plain tensors of the eager step); accumulate with torch.func.grad and fddp.accumulate_grads there"
            )
        with _caller_thread():
            grads, value = torch.func.grad_and_value(self.fn, self.argnums, self.has_aux)(*args, **kwargs)
        if _fully_sharded(flat[1], what):
            return grads, value, SyncInfo(None, None, 0, 0)
        grads, info = _differentiable.ddp_step(tree, grads, options, state, w)
        return grads, value, info

    def with_inputs(self, args: tuple, views: Any) -> list:
        """``args`` with the differentiated argument(s) replaced by ``views`` (a tuple of them for a tuple ``argnums``)."""
        call_args = list(args)
        if isinstance(self.argnums, int):
            call_args[self.nums[0]] = views
        else:
            for a, v in zip(self.nums, views):
                call_args[a] = v
        return call_args

    def _fully_sharded(
        self, scope: _dist.call, args: tuple, kwargs: dict, flat: tuple, options: SyncOptions, state: Any, weight: Any
    ) -> tuple[Any, Any, SyncInfo]:
        """ZeRO stage 3's shards (``fddp.zero.fully_shard``): the backward of the gathers inside
        ``fn`` already averages their gradients, so this is autograd alone, with no sync."""
        what = self.what
        if self.compression is not None or weight is not None or options.check_finite or state is not None:
            raise TypeError(
                f"fddp.{what}: fully sharded parameters (fddp.zero.fully_shard) take no compression, weight=, "
                "check_finite or compression_state: their gradients are averaged by the gathers' backward"
            )
        leaves, spec = flat
        inputs = [t.detach().requires_grad_() for t in leaves]
        call_args = self.with_inputs(args, optree.tree_unflatten(spec, inputs))
        scope.without_header()  # from here the collectives are fully_shard's apply_fn's, on its groups
        with torch.enable_grad(), _caller_thread():
            out = self.fn(*call_args, **kwargs)
            loss = _loss_of(out, self.has_aux, what)
            grads = torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad else [None] * len(inputs)
        # A forward whose backward did not run here (its output unused in this rank's loss) fails
        # the shards' groups as its graph is freed (fddp._dist.dropped): raise it in this call.
        _dist.raise_if_failed_here()
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]
        return optree.tree_unflatten(spec, grads), _detached(out), SyncInfo(None, None, 0, 0)


def _caller_thread() -> Any:
    """Run the backward on this thread, inside this call's scope. On CUDA autograd runs a backward
    on its device thread; the backward of an fddp collective inside ``fn`` (a differentiable psum,
    SyncBatchNorm's sums) is then an fddp call from a second thread while this one holds the
    group, which the scope refuses (``fddp._dist.call``). The CPU's backward runs here already,
    and so does a compiled step's (its backward is in the graph, which dynamo cannot trace this into)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.autograd.set_multithreading_enabled(False)


def _arrive_in_window(reducer: Any, win: Window, i: int, g: torch.Tensor | None) -> None:
    """Hand leaf ``i``'s mean over the window (its last gradient ``g`` added) to the reducer."""
    reducer.arrive(i, window_value(win, i, g))


def _hook_all(inputs: list[torch.Tensor], arrive: Callable[[int, torch.Tensor], None]) -> None:
    """Give every input a backward hook that hands its gradient to ``arrive``.

    The inputs are fresh leaves (detached, requiring grad), so each hook can be installed by
    setting the leaf's hook dictionary, as ``Tensor.register_hook`` ends up doing: one C++ call a
    leaf, where ``register_hook`` first builds a removable handle in Python (about 19k
    instructions a leaf, most of them saved here). The dictionary is the ordered one
    ``register_hook`` would make, so ``fn`` may still register hooks of its own on these leaves
    (they run after fddp's); its key, -1, is one ``RemovableHandle`` never hands out.
    """
    try:
        for i, x in enumerate(inputs):
            hooks = collections.OrderedDict()
            hooks[-1] = functools.partial(arrive, i)
            x._backward_hooks = hooks
    except (AttributeError, TypeError):  # a torch without the setter: the public way
        for i, x in enumerate(inputs):
            x._backward_hooks = None
            x.register_hook(functools.partial(arrive, i))


def _fully_sharded(spec: optree.PyTreeSpec, what: str) -> bool:
    """Whether a tree of this structure holds ZeRO stage 3's shards; raise if it mixes them with other leaves."""
    if not _layout.has_split(spec):
        return False
    stage3 = [n for n in _layout.split_nodes(spec) if n.stage == 3]
    if not stage3:
        return False
    if sum(optree.tree_structure(n, none_is_leaf=True).num_leaves for n in stage3) != spec.num_leaves:
        raise TypeError(
            f"fddp.{what}: the differentiated arguments mix fully sharded parameters (fddp.zero.fully_shard) "
            "with other tensors, whose gradients would need a sync those do not: differentiate them separately"
        )
    return True


def _detached(out: Any) -> Any:
    """``fn``'s output with every tensor detached, in containers optree or torch's pytree knows.

    torch.func detaches ``aux`` through torch's own pytree, where libraries such as transformers
    register their output classes (``ModelOutput``); optree alone would treat those as leaves.
    """
    if type(out) is torch.Tensor:  # the usual output, a loss: a leaf of any pytree
        return out.detach()
    return torch_pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


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


def _check_no_reserved_names(fn: Callable, what: str) -> None:
    """Refuse an ``fn`` with a parameter the returned function keeps for itself."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return
    clash = [name for name in _CALL_TIME if name in params]
    if clash:
        raise TypeError(
            f"fddp.{what}: fn has a parameter named {clash[0]!r}, but the returned function takes "
            f"{clash[0]}= for itself (a per-step sync value); rename fn's parameter or bind it with "
            "functools.partial"
        )


def _loss_of(out: Any, has_aux: bool, what: str) -> torch.Tensor:
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"fddp.{what}(fn, has_aux=True): fn must return a (loss, aux) tuple, got {type(out).__name__}")
        out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() != 0:
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"fddp.{what}: fn must return a scalar tensor (the loss), got {got}")
    return out
