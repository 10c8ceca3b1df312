"""Functional optimizers for pytrees of tensors (optax's design, torch.optim's arithmetic).

An optimizer is a ``GradientTransformation(init, update)`` of two pure functions::

    opt = fddp.optim.adamw(lr=1e-3)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = fddp.optim.apply_updates(params, updates)

or, in one call that runs torch's fused kernels where it can (``sgd``, ``adam``, ``adamw``)::

    params, state = fddp.optim.apply_gradients(opt, grads, state, params)

``update`` never modifies its inputs, keeps the step count as a tensor and never calls
``.item()``, so it works under ``torch.func.vmap`` (an ensemble) and inside ``torch.compile``.
Gradients must be tensors of their parameter's dtype, as torch requires of ``param.grad``: a
``None`` gradient is rejected (pass zeros or drop the leaf), and so is, naming the leaf and both
dtypes, a float64 gradient for a float32 parameter.

:func:`muon` is ``torch.optim.Muon`` for the matrices (to the bit in ``apply_gradients``) with
AdamW, or a transformation of your choice, for the other leaves; on ``fddp.zero``'s shards each
matrix is orthogonalised whole by one rank.

Parameter groups (torch's ``param_groups``) are ``mask=`` on an optimizer (where weight decay
applies) or :func:`multi_transform` (a transformation per label), on replicated parameters and on
``fddp.zero``'s shards alike; hyperparameters that change mid-run live in the state with
:func:`inject_hyperparams` and :func:`set_hyperparams`. :func:`global_norm` is the gradients'
global norm (``torch.nn.utils.get_total_norm``), and :func:`clip_by_global_norm` keeps the norm it
clipped by in its state, for the log.

Beyond those, torch.optim's :func:`rmsprop`, :func:`adagrad`, :func:`nadam`, :func:`radam` and
:func:`adafactor` (torch's keyword names and numbers), and :func:`lamb`, :func:`lars` and :func:`lion`
(optax's numbers). optax's building blocks come under optax's names, arguments and arithmetic: the
transformations (:func:`identity`, :func:`scale`, :func:`trace`, :func:`ema`, :func:`add_decayed_weights`,
:func:`scale_by_learning_rate`, ...), the moment scalings (:func:`scale_by_adam`, :func:`scale_by_rms`,
:func:`scale_by_radam`, :func:`scale_by_lion`, :func:`scale_by_trust_ratio`, ...), :func:`apply_if_finite`
and the schedules (:func:`linear_schedule`, :func:`warmup_cosine_decay_schedule`, ...).
"""

from ._adafactor import AdafactorState, FactoredState, adafactor, scale_by_factored_rms
from ._adagrad import AdagradState, adagrad
from ._adam import AdamState, adam, adamw
from ._base import (
    Applied,
    Apply,
    EmptyState,
    GradientTransformation,
    GradientTransformationExtraArgs,
    apply_gradients,
    apply_updates,
    chain,
    fast_path,
)
from ._clip import ClipByGlobalNormState, clip_by_global_norm, global_norm
from ._finite import ApplyIfFiniteState, apply_if_finite
from ._groups import MaskedNode, MaskedState, MultiTransformState, by_path, masked, multi_transform, set_to_zero
from ._inject import InjectHyperparamsState, inject_hyperparams, set_hyperparams
from ._lion import LionState, ScaleByLionState, lion, scale_by_lion
from ._moments import (
    ScaleByAdamState,
    ScaleByAmsgradState,
    ScaleByRmsState,
    ScaleByRmsWithCountState,
    ScaleByRStdDevState,
    ScaleByRStdDevWithCountState,
    scale_by_adam,
    scale_by_amsgrad,
    scale_by_rms,
    scale_by_stddev,
)
from ._multi_steps import AccumulateState, accumulate
from ._muon import MuonState, muon
from ._nadam import NAdamState, nadam
from ._names import missing_attribute as _missing_attribute
from ._radam import RAdamState, ScaleByRAdamState, radam, scale_by_radam
from ._rmsprop import RMSpropState, rmsprop
from ._schedules import (
    constant,
    constant_schedule,
    cosine_decay,
    cosine_decay_schedule,
    exponential_decay,
    join_schedules,
    linear,
    linear_schedule,
    piecewise_constant_schedule,
    polynomial_schedule,
    warmup_constant_schedule,
    warmup_cosine_decay,
    warmup_cosine_decay_schedule,
    warmup_exponential_decay_schedule,
)
from ._sgd import SGDState, sgd
from ._transforms import (
    EmaState,
    ScaleByScheduleState,
    TraceState,
    WeightDecaySchedule,
    ZeroNansState,
    add_decayed_weights,
    clip,
    ema,
    identity,
    scale,
    scale_by_learning_rate,
    scale_by_schedule,
    trace,
    zero_nans,
)
from ._trust_ratio import LambState, LarsState, lamb, lars, scale_by_trust_ratio

__all__ = [
    # The transformation type, applying updates, composing.
    "GradientTransformation",
    "GradientTransformationExtraArgs",
    "Apply",
    "Applied",
    "fast_path",
    "EmptyState",
    "apply_updates",
    "apply_gradients",
    "chain",
    # Optimizers with torch.optim's fused kernels, and Muon.
    "sgd",
    "SGDState",
    "adam",
    "adamw",
    "AdamState",
    "muon",
    "MuonState",
    # Clipping, parameter groups, hyperparameters in the state, accumulation.
    "clip_by_global_norm",
    "ClipByGlobalNormState",
    "global_norm",
    "multi_transform",
    "MultiTransformState",
    "masked",
    "MaskedState",
    "MaskedNode",
    "set_to_zero",
    "by_path",
    "inject_hyperparams",
    "set_hyperparams",
    "InjectHyperparamsState",
    "accumulate",
    "AccumulateState",
    # Schedules (fddp's short names).
    "constant",
    "linear",
    "cosine_decay",
    "warmup_cosine_decay",
    "exponential_decay",
    # optax's building blocks under optax's names (issue 54).
    "identity",
    "scale",
    "scale_by_schedule",
    "ScaleByScheduleState",
    "scale_by_learning_rate",
    "add_decayed_weights",
    "WeightDecaySchedule",
    "trace",
    "TraceState",
    "ema",
    "EmaState",
    "zero_nans",
    "ZeroNansState",
    "clip",
    "scale_by_adam",
    "ScaleByAdamState",
    "scale_by_amsgrad",
    "ScaleByAmsgradState",
    "scale_by_rms",
    "ScaleByRmsState",
    "ScaleByRmsWithCountState",
    "scale_by_stddev",
    "ScaleByRStdDevState",
    "ScaleByRStdDevWithCountState",
    "ApplyIfFiniteState",
    "apply_if_finite",
    # optax's schedules under optax's names.
    "constant_schedule",
    "linear_schedule",
    "polynomial_schedule",
    "cosine_decay_schedule",
    "warmup_constant_schedule",
    "warmup_cosine_decay_schedule",
    "warmup_exponential_decay_schedule",
    "join_schedules",
    "piecewise_constant_schedule",
    # The all-in-one optimizers of issue 54 (torch's keyword names) and the optax blocks they are made of.
    "RMSpropState",
    "rmsprop",
    "AdagradState",
    "adagrad",
    "NAdamState",
    "nadam",
    "RAdamState",
    "radam",
    "ScaleByRAdamState",
    "scale_by_radam",
    "AdafactorState",
    "adafactor",
    "FactoredState",
    "scale_by_factored_rms",
    "scale_by_trust_ratio",
    "LambState",
    "lamb",
    "LarsState",
    "lars",
    "ScaleByLionState",
    "scale_by_lion",
    "LionState",
    "lion",
]


def __getattr__(name: str):
    """A missing name is an AttributeError that suggests the nearest existing one (``fddp.optim.adamx``)."""
    if name.startswith("__"):
        raise AttributeError(f"module 'fddp.optim' has no attribute {name!r}")
    raise AttributeError(_missing_attribute("fddp.optim", name, __all__))
