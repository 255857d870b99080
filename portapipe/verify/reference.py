"""The float64 (or highest-precision) one-process reference: the whole model in this process, every
replica's micro-batches through it as one plain autograd graph each."""

from __future__ import annotations

import torch

from ..config import Config
from ..compose import build_model
from ..models.expert_parallel import ExpertParallel
from ..models.moe import tie_copies
from ..models.objective import keep_targets
from ..scheduling.executor import mean_loss
from ..scheduling.overlap import Tape, run
from .pipelined import kept_per_microbatch, microbatches, route_by_position, term_means, threads, updated_biases


# -------------------------------------------------------------------------- reference


def reference(config: Config, by_position: bool = False) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The step in one process: (mean loss, gradients by name, router biases after the step);
    ``by_position``: routing forced as :func:`route_by_position` says."""
    loss, grads, biases, _ = reference_step(config, by_position)
    return loss, grads, biases


def reference_step(config: Config, by_position: bool = False) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
    """:func:`reference`, and each loss term's mean over micro-batches and replicas."""
    from ..backends.cpu import CPUBackend

    p = config.parallel
    n_blocks = config.n_blocks()
    replicas, m = p.dp * p.ep, config.schedule.microbatches
    scale = 1.0 / (m * replicas)
    blocks = build_model(config, range(n_blocks), n_blocks, ExpertParallel(CPUBackend()))
    tie_copies(blocks)  # one process holds one of each shared weight (the pipeline's copies are summed)
    keep_targets(blocks.values(), kept_per_microbatch(config))
    if by_position:
        route_by_position(config, [layer for b in range(n_blocks) for layer in blocks[b].moe_layers()])
    losses, terms = [], []
    with threads(1):  # as on the ranks
        for r in range(replicas):
            row, term_row = [], []
            for inputs, targets, *positions in microbatches(config, r):
                tape = Tape(record=False, loss_seed=scale)
                h = inputs
                given = {"positions": positions[0]} if positions else {}
                for b in range(n_blocks):
                    h = run(blocks[b].program(tape, h, targets if b == n_blocks - 1 else None, **given))
                tape.plain_backward(h, torch.full_like(h, scale))
                row.append(float(h.detach()))
                term_row.append({name: float(t) for name, t in tape.terms.items()})
            losses.append(row)
            terms.append(term_row)
    grads = {}
    for b in range(n_blocks):
        for name, q in blocks[b].named_parameters():
            grads[name] = q.grad if q.grad is not None else torch.zeros_like(q)
    return mean_loss(losses), grads, updated_biases(blocks), term_means(terms)
