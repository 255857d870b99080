"""The MoE transformer that follows the stage contract, for every architecture.

``model.arch`` picks the attention, the router and the norms' precision (:data:`ARCHITECTURES`:
portapipe, deepseek_v3, qwen3_moe; see docs/models.md); everything below is shared. The
portapipe architecture is a small DeepSeek-V3-style model:

Layers: RMSNorm -> causal attention (RoPE) -> RMSNorm -> FFN; the first ``n_dense`` layers
have a dense SwiGLU FFN, the rest an MoE: shared expert(s) plus routed experts chosen by
sigmoid affinities, top-k, with DeepSeek's auxiliary-loss-free bias (added to the affinities
for choosing experts only; raised for under-loaded experts and lowered for over-loaded ones
by ``bias_update_speed`` each step) and optional group-limited routing.

The model is built as *blocks* (contiguous layer slices; block 0 has the embedding, the last
the head and loss) so a schedule can place them on ranks. Parameters are named by global
layer index and initialised from a seed per parameter name (per logical expert for routed
experts), so any split, any EP sharding and the single-process model hold identical weights.

Each block's forward is a program (see :mod:`portapipe.scheduling.overlap`): an MoE layer is
the parts ``attention`` (norms, attention, routing, send order) -> dispatch all-to-all of the
rows routed to other EP ranks -> ``shared`` (computed while the dispatch is in flight) ->
``experts`` on the received rows (one grouped matmul per projection over (source rank, expert)
groups) -> combine all-to-all -> ``experts`` on the rows this rank routed to itself (computed
while the combine is in flight) -> ``combine`` (sum of the top-k outputs + residual). Each
row's router weight travels with it (one more column of the dispatched rows) and scales the
expert's activation before the down projection, the same function as weighting the expert's
output but without keeping the outputs for the weights' gradient.

The part-wise backward (:meth:`~portapipe.scheduling.overlap.Tape.backward`) follows the data:
it issues the combine's reverse exchange first; the local rows' experts backward and the shared
expert's backward then run while those rows travel; in a full backward the experts' weight
gradients hide the dispatch's reverse exchange.
"""

from __future__ import annotations

import concurrent.futures
import math
import zlib
from collections.abc import Callable, Generator
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..scheduling.stage import is_expert, mark_shared, shared_blocks
from ..config.setup import layer_range
from .arch import norm
from .layer import Layer, MTPLayer
from .attention import Attention
from .expert_parallel import ExpertParallel
from .functions import RMSNorm
from .linear import Linear, linear
from .objective import Objective, next_token_loss
from .rope import apply_rope, rope_tables
from .routing import Router

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["Attention", "Block", "Router", "apply_rope", "build_blocks", "layer_range", "rope_tables"]

class Block(nn.Module):
    """Layers ``[first, last)`` of the model; block 0 embeds tokens, the final block ends in the loss.

    The last block also holds the ``model.mtp_layers`` multi-token prediction modules
    (:class:`MTPLayer`, in ``layers`` under their global indices after the main layers'), run
    after the head on its normed hidden state.

    Weights two blocks share are one logical weight with a copy in each
    (:func:`~portapipe.scheduling.stage.mark_shared`; their gradients are summed over the copies,
    as DualPipe's copies of a block are): the embedding, when the last block also needs it
    (multi-token prediction, or an output head tied to it, ``model.tie_word_embeddings``). With a
    tied head the last block's logits use its embedding's weight; no head weight of its own exists.
    """

    def __init__(
        self, cfg: ModelConfig, block: int, n_blocks: int, ep: ExpertParallel, seed: int, objective: Objective | None = None, split: Any = None
    ) -> None:
        super().__init__()
        self.objective = Objective() if objective is None else objective
        dtype = DTYPES[cfg.dtype]
        self.block, self.n_blocks = block, n_blocks
        self.is_last = block == n_blocks - 1
        self.first, self.last = layer_range(cfg.n_layers, n_blocks, block, split)  # split: parallel.layers_per_stage
        shares_embed = uses_embedding_last(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden, dtype=dtype) if block == 0 or (self.is_last and shares_embed) else None
        if self.embed is not None and shares_embed and n_blocks > 1:
            mark_shared(self.embed.weight, (0, n_blocks - 1))
        self.layers = nn.ModuleDict({str(i): Layer(cfg, i, ep, dtype) for i in range(self.first, self.last)})
        self.mtp_depth = cfg.mtp_layers if self.is_last else 0
        for k in range(1, self.mtp_depth + 1):
            self.layers[str(cfg.n_layers + k - 1)] = MTPLayer(cfg, k, ep, dtype)
        for layer in self.moe_layers():
            layer.balance_weight = self.objective.seq_aux_weight
        if self.is_last:
            self.final_norm: RMSNorm | None = norm(cfg, cfg.hidden, dtype)
            self.head: Linear | None = None if cfg.tie_word_embeddings else Linear(cfg.hidden, cfg.vocab_size, dtype)
        else:
            self.final_norm = self.head = None
        if not next(self.parameters()).is_meta:  # a build on the meta device has shapes only
            init_parameters(self, cfg, seed)

    @property
    def has_loss(self) -> bool:
        return self.is_last

    def head_weight(self) -> nn.Parameter:
        """The output head's weight ``[vocab, hidden]``: the embedding's when tied."""
        return self.embed.weight if self.head is None else self.head.weight

    def embed_part(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def logits_part(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.final_norm(x), self.head_weight())

    def loss_part(self, x: torch.Tensor, targets: torch.Tensor) -> Any:
        """The main next-token loss; with multi-token prediction also the normed hidden state it read."""
        hn = self.final_norm(x)
        logits = linear(hn, self.head_weight())
        loss = next_token_loss(logits, targets, self.objective.kept_per_microbatch)
        return (loss, hn) if self.mtp_depth else loss

    def main_layers(self) -> list[Layer]:
        """The model's layers in this block, in order (the multi-token prediction modules apart)."""
        return [self.layers[str(i)] for i in range(self.first, self.last)]

    def mtp_layers(self) -> list[MTPLayer]:
        """The multi-token prediction modules, by depth."""
        return [layer for layer in self.layers.values() if isinstance(layer, MTPLayer)]

    def program(
        self, tape: Any, x: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> Generator[Any, None, torch.Tensor]:
        """Forward of one micro-batch: tokens or hidden states in; hidden states or the loss out.
        ``positions``: each token's position in its document, when attention stays inside
        documents (the stage contract, :mod:`portapipe.scheduling.stage`)."""
        x = tape.watch(x)
        if self.block == 0:
            x = tape.part(self.embed_part, x)
        for layer in self.main_layers():
            # layer.memory: recompute / zero-memory options (portapipe.memory.policy), if any.
            x = yield from (layer.program(tape, x, positions) if layer.memory is None else layer.memory.program(layer, tape, x, positions))
        if self.is_last:
            if targets is None:
                raise ValueError(f"block {self.block} computes the loss and needs the targets")
            if not self.mtp_depth:
                return tape.part(self.loss_part, x, targets)
            loss, h = tape.part(self.loss_part, x, targets)
            weight = self.objective.mtp_weight / self.mtp_depth
            for mtp in self.mtp_layers():
                h = yield from mtp.predict(tape, h, targets, self.embed, self.head_weight(), weight, positions)
            x = loss
        return x

    def moe_layers(self) -> list[Layer]:
        return [layer for layer in self.layers.values() if layer.moe is not None]


def tie_copies(blocks: dict[int, Block], together: Callable[[tuple[int, ...]], bool] | None = None) -> None:
    """Blocks held by one process: every copy of a shared weight
    (:func:`~portapipe.scheduling.stage.mark_shared`) becomes the one parameter of the first block
    holding it, so autograd sums its uses as one weight's. ``together(blocks)``: whether this
    process holds every copy of a weight shared by ``blocks`` (default: all of them are among
    ``blocks``, as in the single-process model); a weight whose copies are not together keeps
    them (their gradients are summed over the ranks holding them)."""
    first: dict[str, nn.Parameter] = {}
    for b in sorted(blocks):
        for name, p in list(blocks[b].named_parameters()):
            shared = shared_blocks(p)
            if not shared or not (together(shared) if together is not None else all(c in blocks for c in shared)):
                continue
            if name not in first:
                first[name] = p
                continue
            owner, _, leaf = name.rpartition(".")
            setattr(blocks[b].get_submodule(owner), leaf, first[name])


def uses_embedding_last(cfg: ModelConfig) -> bool:
    """Whether the last block uses the embedding too (and holds a copy when it is not block 0)."""
    return bool(cfg.tie_word_embeddings or cfg.mtp_layers)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))


@torch.no_grad()
def init_parameters(block: Block, cfg: ModelConfig, seed: int) -> None:
    """Seeded per parameter name (per logical expert for routed experts): split-independent.

    Each draw has a generator of its own, so the draws run on the intra-op threads side by side
    (a 3-billion-parameter model's float64 normals take about a minute on one core) and give the
    same values in any order."""
    out_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    gains = {f"{n}.weight" for n, m in block.named_modules() if isinstance(m, RMSNorm)}
    draws: list[tuple[torch.Tensor, str, float]] = []  # (target, generator name, std)
    for name, p in block.named_parameters():
        if name in gains:
            p.fill_(1.0)
            continue
        std = cfg.init_std * (out_scale if name.endswith(("wo.weight", "down.weight", ".down")) else 1.0)
        if is_expert(p):
            experts = block.get_submodule(name.rsplit(".", 1)[0])
            draws += [(p[j], f"{name}[{experts.logical[j]}]", std) for j in range(p.shape[0])]
        else:
            draws.append((p, name, std))

    @torch.no_grad()  # grad mode is per thread: the pool's threads do not inherit this function's
    def draw(target: torch.Tensor, key: str, std: float) -> None:
        target.copy_(torch.randn(target.shape, generator=_generator(seed, key), dtype=torch.float64) * std)

    workers = min(torch.get_num_threads(), len(draws))
    if workers <= 1:
        for d in draws:
            draw(*d)
        return
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(draw, *d) for d in draws]:
            future.result()


def build_blocks(
    cfg: ModelConfig, blocks: list[int], n_blocks: int, ep: ExpertParallel, seed: int, objective: Objective | None = None, split: Any = None
) -> dict[int, Block]:
    """This rank's model blocks, seeded; with ``model.init_from``, holding that folder's weights.
    ``objective``: the weights of the objective's extra terms (none by default); ``split``: the
    layers of each block (``parallel.layers_per_stage``, :func:`~portapipe.config.setup.stage_layers`)."""
    built = {b: Block(cfg, b, n_blocks, ep, seed, objective, split) for b in blocks}
    if cfg.init_from is not None and built and not next(built[blocks[0]].parameters()).is_meta:
        from .hf_folder import load_hf_weights

        load_hf_weights(built.values(), cfg)
    return built


is_expert_param = is_expert
