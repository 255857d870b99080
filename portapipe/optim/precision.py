"""Which dtype does what, and float16's dynamic loss scaling.

``model.dtype`` is the compute dtype (weights as the model sees them, activations);
``train.master_dtype`` the dtype of the master weights, of the gradient accumulation and of
AdamW's state (``auto``: float32 under bfloat16 / float16, else the model dtype);
``train.moments_dtype`` the dtype AdamW's two moments are stored in (``auto``: the master dtype;
DeepSeek-V3 keeps them in bfloat16 under float32 master weights), the update being computed in the
more precise of it and the master dtype (:func:`update_dtype`); ``train.grad_reduce_dtype`` the
dtype gradients travel in when summed over the replicas (``auto``: the master dtype). Everything
here works on dtype names, so config validation stays light.
"""

from __future__ import annotations

import math
from typing import Any

from .adamw import EPS

#: bits of mantissa: the order in which one dtype is "at least as precise" as another
_PRECISION = {"float16": 10, "bfloat16": 7, "float32": 23, "float64": 52}
LOW_PRECISION = ("bfloat16", "float16")
#: float16's smallest value above zero (a subnormal, 2^-24)
FLOAT16_TINY = 2.0**-24


def unit_roundoff(dtype: str) -> float:
    """Half the distance from 1.0 to the next ``dtype`` number: the largest relative error of one
    rounding to nearest (2^-24 for float32, 2^-8 for bfloat16, 2^-11 for float16)."""
    return 2.0 ** -(_PRECISION[dtype] + 1)


def master_dtype(model_dtype: str, setting: str) -> str:
    """The master dtype a config asks for (``auto`` resolved)."""
    if setting != "auto":
        return setting
    return "float32" if model_dtype in LOW_PRECISION else model_dtype


def moments_dtype(model_dtype: str, master_setting: str, setting: str) -> str:
    """The dtype AdamW's moments are stored in (``auto``: the master dtype)."""
    return master_dtype(model_dtype, master_setting) if setting == "auto" else setting


def update_dtype(master: str, moments: str) -> str:
    """The dtype an AdamW update is computed in: the more precise of the master weights' and the
    moments' (float32 for bfloat16 moments under float32 master weights, as Megatron-Core's
    optimizer with bfloat16 ``exp_avg_dtype`` does)."""
    return master if _PRECISION[master] >= _PRECISION[moments] else moments


def smallest_moved(dtype: str, beta: float) -> float:
    """The smallest relative gap ``|target / moment - 1|`` that moves a moment stored in ``dtype``
    when it takes a step of ``1 - beta`` towards its target (the gradient, or its square), for a
    moment at the bottom of its binade: a change below half the dtype's spacing, the unit roundoff
    times the value, rounds away."""
    return unit_roundoff(dtype) / (1.0 - beta)


#: a moment that cannot follow a target closer than this (relative) is said to lag (a note)
MOMENT_LAG = 0.10


def moments_lag(config: Any) -> list[str]:
    """Note lines: moments stored in a dtype too coarse for their betas (with bfloat16 moments and
    beta2 0.999 a squared gradient must differ from exp_avg_sq by 4x its value to move it at
    all); empty when each moment follows targets :data:`MOMENT_LAG` away from it."""
    m, t = config.model, config.train
    dtype = moments_dtype(m.dtype, t.master_dtype, t.moments_dtype)
    if dtype not in _PRECISION:
        return []
    out = []
    for i, (name, what) in enumerate((("exp_avg", "gradient"), ("exp_avg_sq", "squared gradient"))):
        gap = smallest_moved(dtype, t.betas[i])
        if gap > MOMENT_LAG:
            out.append(
                f"train.moments_dtype: {dtype} {name} with betas[{i}] {t.betas[i]:g} may move only when the {what} differs from it by "
                f"more than {100 * gap:.0f}% (a step of {1 - t.betas[i]:.3g} of a smaller gap rounds away in {dtype}); "
                f"DeepSeek-V3 trained bfloat16 moments with betas (0.9, 0.95); use a smaller betas[{i}] or float32 moments"
            )
    return out


def reduce_dtype(model_dtype: str, master_setting: str, setting: str) -> str:
    """The dtype gradients are summed in (``auto``: the master dtype)."""
    return master_dtype(model_dtype, master_setting) if setting == "auto" else setting


def _master_holds(master: str, model: str) -> bool:
    """Whether master weights in ``master`` hold every value of a model in ``model``: as precise,
    and a low-precision master only for a model of that very dtype."""
    return _PRECISION[master] >= _PRECISION[model] and (master not in LOW_PRECISION or master == model)


def precision_problems(config: Any) -> list[str]:
    """Config lines that cannot train: a master dtype less precise than the compute dtype or one
    that cannot hold AdamW's state (float16), FP8 without bfloat16 compute and float32 master
    weights, an EPLB or LPLB migration under a sharded optimizer
    (it moves whole expert rows of optimizer state, which zero_stage 1 / 2 splits over the
    data-parallel replicas)."""
    m, t, b = config.model, config.train, config.balancer
    out = []
    master = master_dtype(m.dtype, t.master_dtype)
    if not _master_holds(master, m.dtype):
        good = ["auto"] + [d for d in _PRECISION if _master_holds(d, m.dtype) and d != "float16"]  # float16 is refused below
        out.append(f"train.master_dtype: {master} is less precise than model.dtype {m.dtype}; use {', '.join(good[:-1])} or {good[-1]}")
    elif master == "float16":
        # AdamW divides by sqrt(v) + eps: both round to zero in float16, and the update becomes inf / nan
        out.append(
            f"train.master_dtype: float16 cannot hold AdamW's state (eps {EPS:g} and squared gradients below "
            f"{FLOAT16_TINY:.1e} round to zero, so the update divides by zero); use auto (float32 under float16), float32 or float64"
        )
    if t.moments_dtype == "float16":
        # v = beta2 v + (1 - beta2) g^2: squared gradients below float16's smallest value vanish,
        # and the update divides by sqrt(v) + eps where eps rounds to zero
        out.append(
            f"train.moments_dtype: float16 cannot hold AdamW's squared gradients (below {FLOAT16_TINY:.1e} they round to zero, "
            f"as does eps {EPS:g}, and the update divides by zero); use auto, bfloat16 (the range of float32), float32 or float64"
        )
    if t.fp8 != "off" and (m.dtype != "bfloat16" or master != "float32"):
        key, value = ("model.dtype", m.dtype) if m.dtype != "bfloat16" else ("train.master_dtype", t.master_dtype)
        out.append(
            f"{key}: {value}; train.fp8: {t.fp8} trains in bfloat16 against float32 master weights (DeepSeek-V3's recipe): "
            "set model.dtype: bfloat16 and train.master_dtype: auto (or float32), or train.fp8: off"
        )
    if t.zero_stage > 0 and b.kind in ("eplb", "lplb") and b.interval <= t.steps:
        out.append(
            f"train.zero_stage: {t.zero_stage} shards the optimizer state that an {b.kind.upper()} rebalance (balancer.interval "
            f"{b.interval} <= train.steps {t.steps}) moves between ranks; use zero_stage 0 or balancer.interval > train.steps"
        )
    return out


class LossScaler:
    """Dynamic loss scaling for float16 (torch.amp.GradScaler's rule): gradients are computed of
    ``scale`` x the loss; a step whose gradients overflow is skipped and halves the scale, and
    ``growth_interval`` clean steps in a row double it. With ``enabled`` False the scale is 1.
    ``in_a_row`` counts the steps skipped since the last applied one (the training loop stops
    at ``train.max_skipped_steps``)."""

    def __init__(self, enabled: bool, init: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init if enabled else 1.0
        self.growth_interval = growth_interval
        self.clean = 0  # steps since the last overflow or growth
        self.overflows = 0
        self.in_a_row = 0

    def update(self, finite: bool) -> bool:
        """After a step's gradients were checked; True when the step may be applied."""
        if not self.enabled:
            return finite
        if not finite:
            self.scale = max(self.scale * 0.5, 1.0)
            self.clean = 0
            self.overflows += 1
            self.in_a_row += 1
            return False
        self.in_a_row = 0
        self.clean += 1
        if self.clean >= self.growth_interval:
            self.scale *= 2.0
            self.clean = 0
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean": float(self.clean), "overflows": float(self.overflows), "in_a_row": float(self.in_a_row)}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if self.enabled and math.isfinite(state.get("scale", math.nan)):
            self.scale = float(state["scale"])
            self.clean = int(state.get("clean", 0))
            self.overflows = int(state.get("overflows", 0))
            self.in_a_row = int(state.get("in_a_row", 0))
