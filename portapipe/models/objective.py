"""The training objective's terms beside the main next-token loss (DeepSeek-V3 report, 2.1.2, 2.2).

- **Multi-token prediction** of depth k = 1..D (``model.mtp_layers``; the modules are
  :class:`~.layer.MTPLayer`): ``CE_k``, the cross-entropy of predicting token i + k + 1, summed
  over the rows that have it and divided by all the micro-batch's positions (the report's 1 / T).
  The objective adds ``lambda / D x sum_k CE_k``, lambda being ``train.mtp_loss_weight`` at the
  step (a number, or a schedule of steps -> weight, as DeepSeek-V3 went from 0.3 to 0.1).

- The complementary **sequence-wise balance loss** of one MoE layer, per sequence of ``T``
  tokens: ``sum_i f_i P_i`` with ``f_i = N_r / (K_r T) x (tokens of the sequence routed to expert
  i)`` and ``P_i = (1 / T) sum_t s'_{i,t}``, ``s'`` each token's affinities normalised to sum 1
  over the ``N_r`` routed experts (:meth:`~.routing.Router.route`). A micro-batch's term is the
  mean over its sequences; it enters the objective as ``train.seq_aux_loss_weight`` (alpha)
  times it, for every MoE layer. It is 1 when every expert gets its share of tokens and
  affinity, more when the router favours the experts it routes to.

The **main next-token loss** (:func:`next_token_loss`) is the mean cross-entropy over a
micro-batch's targets, or, where ``data.mask_eos_loss`` leaves some out, their sum over the step's
kept targets per micro-batch (:attr:`Objective.kept_per_microbatch`): the mean over the step's
micro-batches and replicas is then the mean over the global batch's kept targets
(:mod:`portapipe.data.samples`).

Each term is recorded where it is produced (:meth:`~portapipe.scheduling.overlap.Tape.loss`), so
its gradient enters that stage's backward; the reported values (:func:`term_figures`) are the
terms themselves, unweighted, each the mean over the step's micro-batches and replicas.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

BALANCE = "balance"
MTP = "mtp"


def balance_term(layer: int) -> str:
    """The name under which MoE layer ``layer`` (global index) reports its balance loss."""
    return f"{BALANCE}.{layer}"


def mtp_term(depth: int) -> str:
    """The name under which multi-token prediction depth ``depth`` (1-based) reports its loss."""
    return f"{MTP}.{depth}"


def mtp_weight_at(weight: float | Mapping[int, float], step: int) -> float:
    """lambda at optimizer step ``step`` (0-based): the number, or the schedule's entry with the
    largest step not after ``step``."""
    if not isinstance(weight, Mapping):
        return float(weight)
    return float(weight[max(s for s in weight if s <= step)])


@dataclass
class Objective:
    """The weights of the objective's extra terms on one rank (shared by its blocks)."""

    #: alpha: the weight of every MoE layer's sequence-wise balance loss (0: not computed)
    seq_aux_weight: float = 0.0
    #: ``train.mtp_loss_weight``: lambda, or its schedule (steps -> weight)
    mtp_schedule: float | Mapping[int, float] = 0.0
    #: lambda of the step running (:meth:`at_step`)
    mtp_weight: float = 0.0
    #: the targets the loss keeps in the step's global batch over its micro-batches (replicas x
    #: micro-batches), where ``data.mask_eos_loss`` leaves some out; None: every target counts
    kept_per_microbatch: float | None = None

    def __post_init__(self) -> None:
        self.at_step(0)

    @classmethod
    def from_train(cls, train: object) -> Objective:
        return cls(seq_aux_weight=float(getattr(train, "seq_aux_loss_weight", 0.0)), mtp_schedule=getattr(train, "mtp_loss_weight", 0.0))

    def at_step(self, step: int) -> None:
        """Weigh the terms as optimizer step ``step`` (0-based) does."""
        self.mtp_weight = mtp_weight_at(self.mtp_schedule, step)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, kept_per_microbatch: float | None = None) -> torch.Tensor:
    """A micro-batch's cross-entropy of ``logits[..., vocab]`` against ``targets`` (the
    :data:`~portapipe.data.samples.IGNORE` ones left out): the mean, or given the step's
    ``kept_per_microbatch``, the sum over it (0 when the step keeps no target)."""
    flat, wanted = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if kept_per_microbatch is None:
        return F.cross_entropy(flat, wanted)
    total = F.cross_entropy(flat, wanted, reduction="sum")
    return total / kept_per_microbatch if kept_per_microbatch > 0 else total


def keep_targets(blocks: Iterable[Any], kept_per_microbatch: float | None) -> None:
    """Tell the blocks' loss the step's kept targets per micro-batch (None: every target counts)."""
    for block in blocks:
        block.objective.kept_per_microbatch = kept_per_microbatch


def sequence_balance_loss(affinity: torch.Tensor, idx: torch.Tensor, batch: int) -> torch.Tensor:
    """Mean over the ``batch`` sequences of ``sum_i f_i P_i`` (see the module docstring).

    ``affinity[T, E]``: each token's normalised affinities (rows sum to 1), ``idx[T, K]``: the
    experts each token is routed to; the ``T`` rows are ``batch`` sequences one after the other.
    The counts carry no gradient; ``P`` carries it into the router.
    """
    rows, n_experts = affinity.shape
    k = idx.shape[1]
    if rows % batch:
        raise ValueError(f"{rows} routed tokens do not split into {batch} sequences")
    seq = rows // batch
    p = affinity.view(batch, seq, n_experts).mean(1)
    counts = torch.zeros(batch, n_experts, dtype=affinity.dtype, device=affinity.device)
    counts.scatter_add_(1, idx.reshape(batch, seq * k), torch.ones(batch, seq * k, dtype=affinity.dtype, device=affinity.device))
    f = counts * (n_experts / (k * seq))
    return (f * p).sum(-1).mean()


def balance_terms(moe_layers: Iterable[int], objective: Objective) -> list[str]:
    """The balance-loss terms of these MoE layers (none without a weight)."""
    return [balance_term(i) for i in sorted(moe_layers)] if objective.seq_aux_weight else []


def mtp_terms(depth: int) -> list[str]:
    """The loss terms of ``depth`` multi-token prediction modules."""
    return [mtp_term(k) for k in range(1, depth + 1)]


def term_figures(terms: Mapping[str, float]) -> dict[str, float]:
    """The step's loss terms as reported: ``mtp_loss_<k>`` for each depth (CE_k), ``balance_loss``
    the mean over MoE layers."""
    out: dict[str, float] = {}
    ordered = sorted(terms.items(), key=lambda kv: _order(kv[0]))
    for name, v in ordered:
        if name.startswith(MTP + "."):
            out[f"mtp_loss_{name.partition('.')[2]}"] = v
    balance = [v for name, v in ordered if name.startswith(BALANCE + ".")]
    if balance:
        out["balance_loss"] = sum(balance) / len(balance)
    return out


def _order(name: str) -> tuple[str, int]:
    kind, _, index = name.partition(".")
    return kind, int(index) if index.isdigit() else -1
