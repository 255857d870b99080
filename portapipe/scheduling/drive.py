"""Driving programs: one to completion (a lone action), or two interleaved so that one's compute
hides the other's exchanges in flight (the F&B overlap). A program is a generator that yields
each exchange right after issuing it (see overlap.py)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from .exchange import Pending

Program = Generator[Pending, None, Any]


class Done:
    """A finished exchange (blocking path): same interface as :class:`Pending`."""

    in_flight = False

    def __init__(self, output: torch.Tensor) -> None:
        self.output = output

    def wait(self) -> torch.Tensor:
        return self.output


def run(program: Program) -> Any:
    """Drive one program to completion; return its result."""
    while True:
        try:
            next(program)
        except StopIteration as stop:
            return stop.value


def interleaved(first: Program, second: Program) -> Generator[Pending, None, tuple[Any, Any]]:
    """Program: two programs interleaved, switching whenever the running one has an exchange in
    flight; every exchange is passed on to the driver. Returns both results."""
    programs = [first, second]
    results: list[Any] = [None, None]
    done = [False, False]
    cur = 0
    while not (done[0] and done[1]):
        if not done[cur]:
            try:
                while True:
                    item = next(programs[cur])
                    yield item
                    if item is not None and item.in_flight and not done[1 - cur]:
                        break
            except StopIteration as stop:
                results[cur] = stop.value
                done[cur] = True
        cur = 1 - cur
    return results[0], results[1]


def discard_second(pair: Generator[Pending, None, tuple[Any, Any]]) -> Program:
    """Program: ``pair``'s work, returning its first program's result only."""
    first, _ = yield from pair
    return first


def run_pair(forward: Program, backward: Program) -> tuple[Any, Any]:
    """Run two programs interleaved, switching whenever the running one has an exchange in flight."""
    return run(interleaved(forward, backward))
