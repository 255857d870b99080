"""From a Config to a running pipeline: model blocks, balancer, memory options, executor.

The scheduling core (:mod:`portapipe.scheduling`) runs any stages that follow the stage
contract and knows nothing of portapipe's model or its balancers; this module is where they
meet. :class:`PipelineRuntime` is the executor over portapipe's MoE model as one rank of a
training or verification run builds it:

- the expert-parallel group (:class:`~portapipe.models.expert_parallel.ExpertParallel`), with the
  balancer (:class:`~portapipe.balancing.runtime.ExpertBalancer`) when ``balancer.kind`` asks for
  one: it places the experts the blocks are built with and routes their tokens;
- this rank's model blocks (:func:`build_model`), with the memory options of ``memory`` and on
  the backend's device;
- the executor, told the stage boundary (``[*tokens.shape, hidden]`` in the model's dtype) and
  the model's end-of-step work (:func:`model_end_step`);
- the gradient buckets (:class:`~portapipe.optim.buckets.GradBuckets`) at the executor's seams:
  each block's buckets reduced as soon as its backward work of the step is done, the copies'
  sums (DualPipe's copies of a block, the copies of a weight blocks share: the embedding that
  multi-token prediction or a tied head uses on the last stage) and the balancer's replica sums
  first where they apply;
- the objective's extra terms (:mod:`~portapipe.models.objective`: multi-token prediction, the
  balance loss), which the stages record and the executor reports by the names
  :func:`loss_terms` gives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .backends.base import Backend, ParallelGroups
from .config import Config
from .memory.policy import configure as configure_memory
from .memory.policy import configure_offload
from .models.expert_parallel import ExpertParallel
from .models.fp8_layers import enable_fp8
from .models.layer import Layer
from .models.moe import DTYPES, Block, build_blocks, tie_copies
from .models.objective import Objective, balance_terms, keep_targets, mtp_terms
from .optim.buckets import GradBuckets
from .optim.precision import master_dtype, reduce_dtype
from .scheduling.executor import PipelineExecutor, build_schedule, placed
from .scheduling.ir import Schedule


def build_model(config: Config, blocks: Iterable[int], n_blocks: int, ep: ExpertParallel) -> dict[int, Block]:
    """The model blocks ``blocks`` of a model cut into ``n_blocks``, experts placed as ``ep`` says,
    computing the objective's extra terms the ``train`` section weighs; under ``train.fp8`` its
    eligible Linears in FP8 through ``ep``'s backend."""
    built = build_blocks(
        config.model, list(blocks), n_blocks, ep, config.train.seed, Objective.from_train(config.train), config.stage_split()
    )
    if config.train.fp8 != "off":
        enable_fp8(built, ep.backend, config.memory.fp8_activations)
    return built


def loss_terms(config: Config) -> list[str]:
    """Every loss term the model's stages record (the executor's ``loss_terms``): each depth of
    multi-token prediction, each MoE layer's balance loss (the prediction modules' included)."""
    m = config.model
    return mtp_terms(m.mtp_layers) + balance_terms(range(m.n_dense, m.n_layers + m.mtp_layers), Objective.from_train(config.train))


class PipelineRuntime(PipelineExecutor):
    """One rank of a pp x dp x ep job over portapipe's model: its blocks, its actions, :meth:`step`.

    ``schedule`` replaces the config's (hand-written action lists in tests). Beyond the
    executor: ``config``, ``ep`` (the expert-parallel group), ``balancer`` (None without one)
    and :meth:`moe_layers`.
    """

    def __init__(self, config: Config, backend: Backend, groups: ParallelGroups, schedule: Schedule | None = None) -> None:
        self.config = config
        s = placed(build_schedule(config) if schedule is None else schedule, groups)
        self.ep = ExpertParallel(backend, groups.ep, groups.ep_rank, groups.ep_group)
        if config.balancer.kind != "none":  # EPLB / LPLB: expert slots, routing, replica gradients
            from .balancing.runtime import ExpertBalancer, moe_layer_indices

            layers = moe_layer_indices(config.model, s.blocks_of(groups.pp_rank), s.n_blocks, config.stage_split())
            self.ep.balancer = ExpertBalancer(config, backend, groups, layers)
        blocks = build_model(config, s.blocks_of(groups.pp_rank), s.n_blocks, self.ep)
        configure_memory(blocks, config.memory)  # zero-memory / recompute per layer
        device = backend.device()
        for block in blocks.values():
            block.to(device)
        self.offload = configure_offload(blocks, config.memory, backend)  # memory.offload: saved tensors to the host
        hidden, dtype = config.model.hidden, DTYPES[config.model.dtype]

        def boundary(stage: int, tokens: torch.Size) -> tuple[tuple[int, ...], torch.dtype]:
            return (*tokens, hidden), dtype

        super().__init__(
            s, blocks, backend, groups,
            boundary=boundary, overlap=config.schedule.overlap, exchange_stats=self.ep.stats, end_step=model_end_step,
            counts_stats=self.ep.counts_stats, loss_terms=loss_terms(config),
        )
        if self.offload is not None:  # what a backward reads comes back one compute action ahead
            self.prefetch = self.offload.prefetch
        # a weight blocks on the same ranks share (the embedding of DualPipe's and DualPipeV's first
        # and last blocks: multi-token prediction, a tied head) is one tensor there, not a copy per block
        tie_copies(self.blocks, self.held_together)
        self.check_copies()  # a weight several blocks share starts equal in every copy
        if self.balancer is not None:
            self.balancer.attach(self.moe_layers())
        m, t = config.model, config.train
        self.grad_sync = self.grads = GradBuckets(
            self.blocks, groups, backend,
            master_dtype=DTYPES[master_dtype(m.dtype, t.master_dtype)],
            reduce_dtype=DTYPES[reduce_dtype(m.dtype, t.master_dtype, t.grad_reduce_dtype)],
            zero_stage=t.zero_stage, bucket_mb=t.grad_bucket_mb, overlap=t.overlap_grad_sync,
            copy_sum=self.sum_copies, holders=self.copy_holders,
            before_expert_reduce=self.balancer.reduce_gradients if self.balancer is not None else None,
            idle=self.balancer.idle if self.balancer is not None else None,
        )

    def step(self, microbatches: list[tuple[torch.Tensor, ...]]) -> Any:
        """The executor's step; with ``memory.offload`` its timings add what the step sent to host
        memory (``offload_sent_bytes``) and the most held there at once (``offload_host_peak_bytes``)."""
        result = super().step(microbatches)
        if self.offload is not None:
            result.timings.update(self.offload.take())
        return result

    def set_step(self, step: int) -> None:
        """Weigh the objective's terms as optimizer step ``step`` (0-based) does (``train.mtp_loss_weight``'s schedule)."""
        for block in self.blocks.values():
            block.objective.at_step(step)

    def keep_targets(self, kept_per_microbatch: float | None) -> None:
        """The step's kept targets per micro-batch, which the loss divides by (``data.mask_eos_loss``,
        :func:`~portapipe.models.objective.next_token_loss`); None: the mean over each micro-batch's."""
        keep_targets(self.blocks.values(), kept_per_microbatch)

    @property
    def balancer(self) -> Any:
        """The expert balancer (``after_step``, ``state_dict``, ``load_state_dict``), or None."""
        return self.ep.balancer

    def moe_layers(self) -> list[Layer]:
        """This rank's MoE layers, by global layer index."""
        layers = [layer for block in self.blocks.values() for layer in block.moe_layers()]
        return sorted(layers, key=lambda layer: layer.index)

    @contextlib.contextmanager
    def unchanged(self) -> Iterator[Callable[[], None]]:
        """What runs inside (a step that is not training's: validation, a retried verification)
        leaves this rank as it found it: every buffer (the routers' biases, the step's expert
        counts), the RNG, and the attributes of the experts' clocks and of the balancer, its
        replica switch and LP planners (the figures a step leaves for the next). A step writes
        gradients, never the parameters: they are not copied. The context yields ``keep``:
        called inside, the state the block leaves is kept instead (a retried step that succeeded)."""
        tensors = [t for block in self.blocks.values() for t in block.buffers()]
        saved = [t.detach().clone() for t in tensors]
        objects = [layer.moe.clock for layer in self.moe_layers()]
        if self.balancer is not None:
            objects += [self.balancer, self.balancer.switch, *self.balancer.planners]
        attributes = [dict(vars(o)) for o in objects]
        rng = self.backend.get_rng_state()
        kept: list[bool] = []
        try:
            yield lambda: kept.append(True)
        finally:
            if not kept:
                with torch.no_grad():
                    for t, old in zip(tensors, saved):
                        t.copy_(old)
                for o, attrs in zip(objects, attributes):
                    vars(o).clear()
                    vars(o).update(attrs)
                self.backend.set_rng_state(rng)


def model_end_step(rt: PipelineRuntime) -> dict[str, Any]:
    """The model's end of a step, after the gradient reduction (collective).

    (A balancer's replica sums of expert gradients run inside the reduction.) The step's expert
    loads are summed over DualPipe's copies, the EP group and DP, and every router's
    aux-loss-free bias takes one step on them. Returns the StepResult fields ``expert_counts``
    (summed over EP only, this rank's MoE layers) and ``expert_layers``.
    """
    g = rt.groups
    by_block = {b: block.moe_layers() for b, block in rt.blocks.items()}
    if not any(by_block.values()):
        return {"expert_counts": None, "expert_layers": []}
    for b, layers in by_block.items():
        if b in rt.copy_rank and layers:
            both = rt.sum_over_copies(b, torch.stack([layer.moe.step_counts for layer in layers]))
            for layer, row in zip(layers, both):
                layer.moe.step_counts.copy_(row)
    layers = rt.moe_layers()
    counts = torch.stack([layer.moe.step_counts for layer in layers])
    if g.ep > 1:
        rt.backend.all_reduce(counts, group=g.ep_group)
    ep_counts = counts.clone()
    if g.dp > 1:
        rt.backend.all_reduce(counts, group=g.dp_group)
    for layer, row in zip(layers, counts):
        layer.moe.router.update_bias(row)
        layer.moe.step_counts.zero_()
    return {"expert_counts": ep_counts, "expert_layers": [layer.index for layer in layers]}
