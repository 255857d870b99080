"""Your own model pipelined with DualPipeV on 2 CPU ranks, checked against one process.

    python examples/own_model.py
"""

import torch
from torch import nn

import portapipe
from portapipe.ranks.launch import run_ranks

MICROBATCHES = 4


def build() -> list[nn.Module]:
    """The model as 4 blocks (DualPipeV on 2 ranks has 4 stages); the same on every rank."""
    torch.manual_seed(0)
    block = lambda: nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.LayerNorm(32))  # noqa: E731
    return [nn.Sequential(nn.Embedding(100, 32), block()), block(), block(), nn.Sequential(block(), nn.Linear(32, 100))]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 100, (8, 17), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def rank(backend) -> tuple[float, dict[str, torch.Tensor]]:
    torch.set_default_dtype(torch.float64)  # exact comparison with one process
    pipe = portapipe.pipeline(build(), backend=backend, schedule="dualpipev", microbatches=MICROBATCHES, loss_fn=loss_fn)
    result = pipe.step(*data())
    return result.loss, {name: p.grad for name, p in pipe.named_parameters()}


def main() -> None:
    results = run_ranks(rank, 2)
    torch.set_default_dtype(torch.float64)
    model = nn.Sequential(*build())
    x, y = data()
    losses = [loss_fn(model(xm), ym) for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))]
    (sum(losses) / MICROBATCHES).backward()
    ref_loss = sum(v.item() for v in losses) / MICROBATCHES  # summed in micro-batch order, as the pipeline does
    grads = {name: g for _, named in results for name, g in named.items()}
    worst = max(float((grads[n] - p.grad).norm() / p.grad.norm()) for n, p in model.named_parameters())
    print(f"pipelined loss {results[0][0]:.12f}, one process {ref_loss:.12f}, largest relative gradient difference {worst:.1e}")
    assert results[0][0] == ref_loss and worst <= 1e-12 and grads.keys() == dict(model.named_parameters()).keys()


if __name__ == "__main__":
    main()
