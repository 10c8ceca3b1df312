"""PowerSGD: low-rank gradient compression as a comm hook, with its state as a pytree.

:class:`PowerSGD` is an immutable configuration passed as ``compression=`` to :func:`fddp.ddp_step`
and a :class:`fddp.hooks.CommHook`. It keeps state between steps
(the step count, error-feedback residuals, warm-start factors and the seed generator); that state is
a :class:`PowerSGDState` pytree of tensors that goes into ``ddp_step`` and comes out in
``info.compression_state``, so a training step stays pure and the state checkpoints with
:mod:`fddp.checkpoint` like any optimizer state.

PowerSGD follows torch's ``powerSGD_hook`` (Vogels et al., 2019) step for step, with the same
arithmetic, so for the same gradients and the same buckets the results are bitwise equal to it
(tested against DDP with the hook): per bucket, the error of the previous step is added, every leaf
viewed as an ``(n, m)`` matrix (``shape[0]`` rows) that compression shrinks by more than
``min_compression_rate`` is compressed to rank ``r``, the rest travel uncompressed in one flat
all-reduce, and ``M ~ P Q^T`` comes from two all-reduces: ``P = M Q`` (summed, then
orthogonalised) and ``Q = M^T P`` (averaged). "The same buckets" matters because fresh ``Q``
factors are drawn per bucket, in the order of the leaves in it; a plain ``dict`` of parameters
flattens in sorted key order, an ``OrderedDict`` in insertion order (DDP's). The steps before
``start_iter`` are an uncompressed mean (summed, then divided; half-precision buckets divided
first), where torch's hook divides first; the two agree bitwise for a power-of-two group (scaling
by ``2**-k`` is exact) and to a few ulps otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np
import optree
import torch

from fddp import _layout, _pool
from fddp._layout import Bucket, BucketPlan
from fddp._tree import paths
from fddp.sync._comm import Comm
from fddp.sync.hooks import LOW_PRECISION, CommHook, GradBucket

__all__ = ["PowerSGD", "PowerSGDState"]

_MAX_SEED = 1_000_000_000  # torch's PowerSGDState draws Q's seeds as rng.randint(1_000_000_000)


class PowerSGDState(NamedTuple):
    """PowerSGD's state between steps: a pytree of tensors, checkpointable as it is.

    Attributes:
        step: int64 scalar, the number of synchronisations so far; compression starts when it
            reaches ``start_iter``.
        rng: int64 ``(625,)``, the state of the NumPy MT19937 generator that draws one seed per
            bucket whenever fresh random ``Q`` factors are needed (torch's convention, so the same
            ``seed`` gives torch's ``Q``).
        error: with error feedback, a tree shaped like the parameters holding each leaf's
            residual (this rank's input last step minus what came back); ``None`` otherwise.
            Residuals differ between ranks, so to resume exactly every rank saves its own state
            (e.g. ``fddp.checkpoint.save(path_r, state, group=own)`` with ``own`` a group of one
            rank from ``torch.distributed.new_subgroups(group_size=1)``); the other fields are
            the same on every rank.
        q: with warm start, a tree shaped like the parameters holding each compressed leaf's last
            ``Q`` factor, ``(m, rank)``, and ``None`` at uncompressed leaves; ``None`` otherwise.
    """

    step: torch.Tensor
    rng: torch.Tensor
    error: Any
    q: Any



@dataclasses.dataclass(frozen=True)
class PowerSGD(CommHook):
    """Rank-``rank`` PowerSGD compression with error feedback and warm start, as torch's hook.

    Immutable configuration; :meth:`init` makes the state, which ``ddp_step`` takes as
    ``compression_state=`` and returns, updated, as ``info.compression_state``. Before step
    ``start_iter`` buckets are all-reduced uncompressed (the state only counts steps). Torch
    requires ``start_powerSGD_iter > 1`` because DDP rebuilds its buckets after the first step;
    fddp's buckets never change, so any ``start_iter >= 0`` is allowed.

    Per step and bucket, PowerSGD sends ``n * r + m * r`` elements for each compressed ``(n, m)``
    matrix (in two all-reduces, P and Q, for the whole bucket) plus every uncompressed element (in
    one more); ``info.bytes_sent`` counts them.

    Args:
        rank: the rank ``r`` of the approximation (torch's ``matrix_approximation_rank``).
        start_iter: the number of uncompressed steps first (torch's ``start_powerSGD_iter``).
        min_compression_rate: compress an ``(n, m)`` matrix only if
            ``(n + m) * r * min_compression_rate < n * m``.
        error_feedback: add last step's compression error to this step's gradient.
        warm_start: start each step's power iteration from the last step's ``Q`` instead of a
            fresh random one.
        orthogonalization_epsilon: added to column norms in Gram-Schmidt, against division by zero.
        seed: seeds the generator of the random ``Q`` factors (torch's ``random_seed``).

    Example:
        >>> ps = fddp.PowerSGD(rank=2, start_iter=10)
        >>> state = ps.init(params)
        >>> grads, info = fddp.ddp_step(params, grads, compression=ps, compression_state=state, return_info=True)
        >>> state = info.compression_state
    """

    rank: int = 1
    start_iter: int = 1000
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "start_iter", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "rank" else 0):
                raise ValueError(f"fddp.PowerSGD: {name} must be an int >= {1 if name == 'rank' else 0}, got {v!r}")
        if not self.min_compression_rate >= 0 or not self.orthogonalization_epsilon >= 0:
            raise ValueError(
                "fddp.PowerSGD: min_compression_rate and orthogonalization_epsilon must be >= 0, got "
                f"{self.min_compression_rate!r} and {self.orthogonalization_epsilon!r}"
            )

    def compressed_shape(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """Return ``(n, m, r)`` if a leaf of this shape is compressed, else ``None``.

        Example:
            >>> fddp.PowerSGD(rank=2).compressed_shape((64, 3, 3))
            (64, 9, 2)
        """
        if len(shape) < 1:
            return None
        n = shape[0]
        m = 1
        for d in shape[1:]:
            m *= d
        r = min(n, m, self.rank)
        return (n, m, r) if (n + m) * r * self.min_compression_rate < n * m else None

    def q_shape(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """Return the shape of the ``Q`` factor of a leaf of this shape, ``None`` if uncompressed."""
        nmr = self.compressed_shape(shape)
        return None if nmr is None else (nmr[1], nmr[2])

    def init(self, params: Any, /) -> PowerSGDState:
        """Return the state before the first step, for a tree shaped like ``params``.

        Example:
            >>> state = fddp.PowerSGD(rank=1, start_iter=100).init(params)
        """
        error = optree.tree_map(torch.zeros_like, params) if self.error_feedback else None

        def q0(p: torch.Tensor) -> torch.Tensor | None:
            shape = self.q_shape(tuple(p.shape))
            return None if shape is None else torch.zeros(shape, dtype=p.dtype, device=p.device)

        q = optree.tree_map(q0, params) if self.warm_start else None
        return PowerSGDState(torch.tensor(0, dtype=torch.int64), _rng_tensor(np.random.RandomState(self.seed)), error, q)

    def expected_bytes(self, params: Any, /, *, compressed: bool = True) -> int:
        """Return the payload bytes one step sends for ``params`` (uncompressed if not ``compressed``).

        Example:
            >>> ps = fddp.PowerSGD(rank=2)
            >>> ps.expected_bytes(params, compressed=False) / ps.expected_bytes(params)  # the compression factor
        """
        total = 0
        for p in optree.tree_leaves(params):
            shape = self.compressed_shape(tuple(p.shape)) if compressed else None
            total += p.element_size() * (p.numel() if shape is None else (shape[0] + shape[1]) * shape[2])
        return total

    # --- the comm hook (see fddp.hooks) ---------------------------------------------------------

    def cannot_carry(self, dtype: torch.dtype) -> str | None:
        if dtype.is_complex:
            return "its factors are computed with plain transposes (Q = M^T P), not the conjugate transposes complex matrices need"
        return None

    def signature(self, state: Any) -> str:
        # Ranks that disagree on whether this step compresses would send buffers of different
        # sizes; the switch changes the string once, which costs one extra signature check.
        step = getattr(state, "step", None)
        compressing = int(step) >= self.start_iter if isinstance(step, torch.Tensor) else "unknown"
        return f"{self!r} compressing={compressing}"

    def begin(self, state: Any, comm: Comm) -> "_Call":
        return _Call(self, check_state(self, state, comm.what), comm)

    def launch(self, call: "_Call", bucket: GradBucket) -> tuple[Any, Any]:
        return call.launch(bucket), call

    def finish(self, call: "_Call", bucket: GradBucket, pending: Any) -> tuple[Any, Any]:
        return call.finish(bucket, pending), call

    def end(self, call: "_Call") -> PowerSGDState:
        return call.new_state()


def check_state(config: PowerSGD, state: Any, what: str) -> PowerSGDState:
    """Return ``state`` if it looks like a :class:`PowerSGDState`, else raise saying what arrived."""
    if not (isinstance(state, tuple) and len(state) == 4 and isinstance(getattr(state, "step", None), torch.Tensor)):
        raise ValueError(
            f"fddp.{what}: compression={config!r} needs compression_state= (from its init(params), "
            f"then each step's info.compression_state), got {type(state).__name__}"
        )
    return state


# --- the generator of Q's seeds, as a tensor ----------------------------------------------------


def _rng_tensor(rs: np.random.RandomState) -> torch.Tensor:
    _, keys, pos, _, _ = rs.get_state(legacy=True)
    return torch.tensor(np.append(keys.astype(np.int64), pos), dtype=torch.int64)


def _draw_seed(rng: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Draw one seed as torch's ``PowerSGDState.rng.randint(1_000_000_000)``; return it and the new state."""
    a = rng.cpu().numpy()
    rs = np.random.RandomState()
    rs.set_state(("MT19937", a[:624].astype(np.uint32), int(a[624])))
    seed = int(rs.randint(_MAX_SEED))
    return seed, _rng_tensor(rs)


# --- orthogonalisation, as torch's powerSGD_hook._orthogonalize ---------------------------------


def _orthogonalize(matrices: torch.Tensor, epsilon: float) -> None:
    """Orthonormalise the columns of each ``(batch, n, r)`` matrix in place (``n >= r``)."""
    rank = matrices.shape[2]
    if rank <= 2 or matrices.dtype in (torch.float16, torch.bfloat16):
        for i in range(rank):
            col = matrices[:, :, i : i + 1]
            norm = torch.norm(col, dim=1, keepdim=True)
            # epsilon guards against an all-zero column (a layer whose gradient vanished); torch
            # adds it only when it is nonzero, and so must we to round the same.
            col /= norm + epsilon if epsilon else norm
            if i + 1 < rank:
                rest = matrices[:, :, i + 1 :]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        r = torch.empty(matrices.shape[0], rank, rank, device=matrices.device, dtype=matrices.dtype)
        torch.linalg.qr(matrices, out=(matrices, r))


# --- one synchronisation ------------------------------------------------------------------------


class _Bucket:
    """One bucket's tensors between launch and finish."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat  # the error-fed input (with error feedback, the next residual)
        self.out = flat  # where the result goes
        self.uncompressed: list[torch.Tensor] = []  # views into flat
        self.u_pos: list[int] = []  # their positions in the bucket
        self.u_buf: torch.Tensor | None = None
        self.u_work: Any = None
        self.matrices: list[torch.Tensor] = []  # (1, n, m) views into flat
        self.leaf_ids: list[int] = []  # the leaf index of each matrix
        self.m_pos: list[int] = []  # its position in the bucket
        self.ps: list[torch.Tensor] = []
        self.qs: list[torch.Tensor] = []
        self.p_buf: torch.Tensor | None = None
        self.q_buf: torch.Tensor | None = None
        self.p_work: Any = None
        self.q_work: Any = None
        self.round = 0  # finish calls so far: P's round trip, then Q's

    def uncompressed_out(self, layout: Bucket) -> list[torch.Tensor]:
        """The uncompressed leaves' places in ``out``, in the order of ``uncompressed``."""
        if self.out is self.flat:
            return self.uncompressed
        outs = self.out.split(layout.numels)
        return [outs[k] for k in self.u_pos]

    def matrices_out(self, layout: Bucket) -> list[torch.Tensor]:
        """The compressed leaves' places in ``out``, as ``(1, n, m)`` matrices in the order of ``matrices``."""
        if self.out is self.flat:
            return self.matrices
        outs = self.out.split(layout.numels)
        return [outs[k].view(m.shape) for k, m in zip(self.m_pos, self.matrices)]


class _Call:
    """PowerSGD's working state for one synchronisation of a bucket plan.

    ``launch`` takes each bucket's flat gradient (which it may overwrite) and starts the
    uncompressed and ``P`` all-reduces; the first ``finish`` orthogonalises ``P`` and sends ``Q``,
    the second rebuilds the bucket. Before ``start_iter`` buckets take the uncompressed mean (summed,
    then divided) and only the state's step count moves.
    """

    def __init__(self, config: PowerSGD, state: PowerSGDState, comm: Comm) -> None:
        self.config, self.comm, self.plan = config, comm, comm.plan
        self.state = state
        self.step = int(state.step)
        self.compressing = self.step >= config.start_iter
        self.first = self.step == config.start_iter  # the first compressed step: no residual, no Q yet
        self.rng = state.rng
        self.error, self.error_spec = (None, None)
        self.q, self.q_spec = (None, None)
        if self.compressing and config.error_feedback:
            self.error, self.error_spec = _leaves(state.error, self.plan, comm.what, "error", lambda shape: shape)
        if self.compressing and config.warm_start:
            self.q, self.q_spec = _leaves(state.q, self.plan, comm.what, "q", config.q_shape)
        # Last step's residuals, one buffer per bucket where they came laid out in this plan (the
        # previous call's own result): added in one op per bucket.
        flat = _layout.flat_of(self.error) if self.error is not None else None
        self.residuals = flat.buffers if flat is not None and flat.plan == self.plan else None
        self.new_error: list[Any] | None = [None] * len(self.plan.buckets) if self.error is not None else None
        self.new_q = list(self.q) if self.q is not None else None

    def launch(self, bucket: GradBucket) -> Any:
        """Compress the bucket and start its uncompressed and ``P`` all-reduces."""
        if not self.compressing:
            if bucket.buffer.dtype in LOW_PRECISION:  # divided first, so the sum cannot overflow
                bucket.buffer.div_(self.comm.world_size)
            return self.comm.all_reduce(bucket.buffer)
        s = _Bucket(bucket.buffer)
        views = s.flat.split(bucket.layout.numels)
        self._add_residual(bucket, s.flat, views)
        self._lay_out_factors(bucket.layout, s, views)
        self._start_q(s)
        for q in s.qs:
            _orthogonalize(q, self.config.orthogonalization_epsilon)
        for matrix, q, p in zip(s.matrices, s.qs, s.ps):
            torch.bmm(matrix, q, out=p)
        if s.uncompressed:
            s.u_buf = _pool.new_buffer(sum(v.numel() for v in s.uncompressed), s.flat.dtype, s.flat.device)
            torch.cat([v.reshape(-1) for v in s.uncompressed], out=s.u_buf)
            s.u_work = self.comm.all_reduce(s.u_buf)
        if s.matrices:
            # P is orthogonalised after the sum, so it needs no division by the world size.
            s.p_work = self.comm.all_reduce(s.p_buf)
        return s

    def _add_residual(self, bucket: GradBucket, flat: torch.Tensor, views: Sequence[torch.Tensor]) -> None:
        """Error feedback: add last step's residual to this step's input."""
        if self.error is None or self.first:
            return
        if self.residuals is not None:
            flat.add_(self.residuals[bucket.index])
        else:
            for v, leaf in zip(views, bucket.layout.indices):
                v.add_(self.error[leaf].reshape(-1))

    def _lay_out_factors(self, b: Bucket, s: _Bucket, views: Sequence[torch.Tensor]) -> None:
        """Sort the bucket's leaves into uncompressed ones and ``(1, n, m)`` matrices, and lay out
        every matrix's ``P`` (``n x r``) and ``Q`` (``m x r``) in one buffer each."""
        cfg = self.config
        # Group compressed matrices by shape, in first-seen order: torch's order, which fixes
        # which random numbers each fresh Q receives.
        groups: dict[tuple[int, int, int], list[tuple[int, int, torch.Tensor]]] = {}
        for k, (v, leaf, shape) in enumerate(zip(views, b.indices, b.shapes)):
            nmr = cfg.compressed_shape(shape)
            if nmr is None:
                s.uncompressed.append(v)
                s.u_pos.append(k)
            else:
                groups.setdefault(nmr, []).append((k, leaf, v.view(1, nmr[0], nmr[1])))
        sizes = [(n, m, r) for (n, m, r), members in groups.items() for _ in members]
        s.p_buf = torch.empty(sum(n * r for n, _, r in sizes), dtype=s.flat.dtype, device=s.flat.device)
        s.q_buf = torch.empty(sum(m * r for _, m, r in sizes), dtype=s.flat.dtype, device=s.flat.device)
        p_at = q_at = 0
        for (n, m, r), members in groups.items():
            for k, leaf, matrix in members:
                s.m_pos.append(k)
                s.leaf_ids.append(leaf)
                s.matrices.append(matrix)
                s.ps.append(s.p_buf[p_at : p_at + n * r].view(1, n, r))
                s.qs.append(s.q_buf[q_at : q_at + m * r].view(1, m, r))
                p_at, q_at = p_at + n * r, q_at + m * r

    def _start_q(self, s: _Bucket) -> None:
        """``Q`` before its orthogonalisation: last step's (warm start), or fresh random numbers."""
        if self.q is None or self.first:
            # One seed per bucket, drawn even when the bucket has nothing to compress, as torch does.
            seed, self.rng = _draw_seed(self.rng)
            gen = torch.Generator().manual_seed(seed)
            for q in s.qs:
                q.copy_(torch.randn(*q.shape, generator=gen, dtype=q.dtype))
        else:
            for q, leaf in zip(s.qs, s.leaf_ids):
                q.copy_(self.q[leaf].view(q.shape))

    def finish(self, bucket: GradBucket, s: Any) -> Any:
        """First call: the uncompressed part and ``P``, then send ``Q``. Second call: decompress."""
        comm, world = self.comm, self.comm.world_size
        if not self.compressing:
            comm.wait(s, f"the all-reduce of bucket {bucket.index}")
            return bucket.buffer if bucket.buffer.dtype in LOW_PRECISION else bucket.buffer.div_(world)
        if s.round == 0:
            s.round = 1
            self._receive_p_send_q(bucket, s)
            return s  # another round: every bucket sends its Q before any waits for one
        return self._receive_q(bucket, s)

    def _receive_p_send_q(self, bucket: GradBucket, s: _Bucket) -> None:
        """The uncompressed leaves' mean into place; ``P`` summed and orthogonalised; ``Q`` sent."""
        comm, i = self.comm, bucket.index
        # With error feedback the input stays in s.flat (it becomes the residual, in place);
        # the result goes to a new buffer. Without, the result overwrites the input.
        s.out = _layout.new_flat(bucket.layout) if self.new_error is not None else s.flat
        if s.u_work is not None:
            comm.wait(s.u_work, f"the uncompressed all-reduce of bucket {i}")
            at = 0
            u = s.u_buf.div_(comm.world_size)
            for v in s.uncompressed_out(bucket.layout):
                v.copy_(u[at : at + v.numel()])
                at += v.numel()
        if s.p_work is not None:
            comm.wait(s.p_work, f"the P all-reduce of bucket {i}")
            for p in s.ps:
                _orthogonalize(p, self.config.orthogonalization_epsilon)
            for matrix, p, q in zip(s.matrices, s.ps, s.qs):
                torch.bmm(matrix.transpose(1, 2), p, out=q)
            s.q_work = comm.all_reduce(s.q_buf)

    def _receive_q(self, bucket: GradBucket, s: _Bucket) -> torch.Tensor:
        """``Q``'s mean; the matrices rebuilt as ``P Q^T``; the residual and the warm start kept."""
        i = bucket.index
        if s.q_work is not None:
            self.comm.wait(s.q_work, f"the Q all-reduce of bucket {i}")
            s.q_buf.div_(self.comm.world_size)
            for p, q, matrix in zip(s.ps, s.qs, s.matrices_out(bucket.layout)):
                torch.bmm(p, q.transpose(1, 2), out=matrix)
        if self.new_error is not None:
            # The residual: this step's input minus what came back, written over the input.
            self.new_error[i] = s.flat.sub_(s.out)
        if self.new_q is not None:
            for leaf, q in zip(s.leaf_ids, s.qs):
                self.new_q[leaf] = q.view(q.shape[1:])
        return s.out

    def new_state(self) -> PowerSGDState:
        step = torch.tensor(self.step + 1, dtype=torch.int64)
        if not self.compressing:  # before start_iter: only the count moves
            return self.state._replace(step=step)
        return PowerSGDState(
            step,
            self.rng,
            None if self.new_error is None else optree.tree_unflatten(self.error_spec, _layout.lay_out(self.plan, self.new_error)),
            None if self.new_q is None else optree.tree_unflatten(self.q_spec, self.new_q),
        )


def _leaves(
    tree: Any, plan: BucketPlan, what: str, field: str, expect: Callable[[tuple[int, ...]], tuple[int, ...] | None]
) -> tuple[list[Any], Any]:
    """Flatten a params-shaped state field; raise naming the first leaf that does not fit the params."""
    if tree is None:
        raise ValueError(
            f"fddp.{what}: compression_state.{field} is None, but this PowerSGD config needs it; make "
            "the state with the same config's init(params)"
        )
    leaves, spec = optree.tree_flatten(tree, none_is_leaf=True)
    if len(leaves) != plan.num_leaves:
        raise ValueError(
            f"fddp.{what}: compression_state.{field} has {len(leaves)} leaves, but params have "
            f"{plan.num_leaves}; make the state with PowerSGD.init(params)"
        )
    shapes = {i: s for b in plan.buckets for i, s in zip(b.indices, b.shapes)}
    for i, (path, leaf) in enumerate(zip(paths(spec), leaves)):
        want = expect(shapes[i])
        got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None if leaf is None else type(leaf).__name__
        if got != want:
            raise ValueError(
                f"fddp.{what}: compression_state.{field} leaf {path!r} should be "
                f"{'None' if want is None else f'a tensor of shape {want}'}, got "
                f"{'None' if got is None else got}; make the state with the same config's init(params)"
            )
    return leaves, spec
