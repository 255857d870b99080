"""What ``portapipe verify`` reports for one config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .tolerance import EXACT, Tolerance


@dataclass
class VerifyReport:
    schedule: str
    pp: int
    ep: int
    dp: int
    microbatches: int
    loss_diff: float
    max_rel_grad_diff: float
    ok: bool
    precision: str = "float64"
    tolerance: Tolerance = EXACT
    #: dtype keys verify changed from the config to check in ``precision`` (key -> "was -> now")
    changed: dict[str, str] = field(default_factory=dict)
    #: float16 checked in its own dtype: the loss scale of the step (the first without overflow)
    loss_scale: float | None = None
    #: beyond the printed keys: for tests and diagnosis
    overlap: bool = True
    w_split: bool = True
    loss: float = 0.0
    ref_loss: float = 0.0
    max_bias_diff: float = 0.0
    worst_param: str = ""
    timings: list[dict[str, float]] = field(default_factory=list)
    #: the largest difference of a loss term's mean (relative to the reference's), over terms and ranks
    loss_terms_diff: float = 0.0
    #: the reference's loss terms (name -> mean)
    ref_loss_terms: dict[str, float] = field(default_factory=dict)
    #: a measured tolerance's check: the distances from the float64 reference (absolute loss, relative gradients)
    float64_loss_diff: float | None = None
    float64_grad_diff: float | None = None
    #: the batch the step ran on (:func:`~.pipelined.generated_batch`)
    batch: dict[str, Any] = field(default_factory=dict)
    #: under ``train.fp8``: how many of the model's Linears ran in FP8 on the ranks (None: FP8 off)
    fp8_linears: int | None = None

    def summary(self) -> dict[str, Any]:
        """The ``portapipe verify`` JSON: schedule, pp, ep, dp, microbatches, loss_diff,
        max_rel_grad_diff, ok, precision, the dtype keys changed to check in it, float16's loss
        scale (null otherwise) and the tolerance it was judged by; with loss terms (balance loss,
        multi-token prediction), their names and ``loss_terms_diff``; checked against the one-process
        step in the same dtypes (``--precision model``), the distances from the float64 one
        (``float64``: loss_diff, max_rel_grad_diff); the batch it ran on (``batch``: generated,
        its sequences, tokens and documents, the config's data not read); under ``train.fp8``, how
        many Linears ran in FP8 (``fp8_linears``)."""
        keys = ("schedule", "pp", "ep", "dp", "microbatches", "loss_diff", "max_rel_grad_diff", "ok", "precision", "changed", "loss_scale")
        out = {**{k: getattr(self, k) for k in keys}, "tolerance": self.tolerance.as_dict(), "batch": self.batch}
        if self.fp8_linears is not None:
            out["fp8_linears"] = self.fp8_linears
        if self.float64_loss_diff is not None:
            out["float64"] = {"loss_diff": self.float64_loss_diff, "max_rel_grad_diff": self.float64_grad_diff}
        if self.ref_loss_terms:
            out.update(loss_terms=sorted(self.ref_loss_terms), loss_terms_diff=self.loss_terms_diff)
        return out
