"""An exponential moving average of the weights in host memory (``train.ema_decay``).

DeepSeek-V3 keeps an EMA of the model parameters in CPU memory, updated asynchronously after each
step, to estimate the model's quality after learning-rate decay early (technical report, 3.2.3).
:class:`HostEMA` keeps, for each of the optimizer's buckets, the range of it this rank updates
(the whole bucket under ``zero_stage`` 0, this rank's shard under 1 and 2, like the master
weights) as float32 in host memory: ``ema = decay x ema + (1 - decay) x weights``.

After an optimizer step, :meth:`HostEMA.update` starts copying the updated weights (the master
weights, or the parameters where they are the master) into host staging buffers, records an
event of the device and hands the fold to a background thread, which waits for the event and
folds the copies in; the training goes on. The next update first waits for the previous fold
(its staging buffers are reused): a fold takes a few element-wise passes over host memory, far
less than a step. Nothing of it stays on the device.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class HostEMA:
    """The EMA of ``optimizer``'s weights (a :class:`~.sharded.ShardedAdamW`), kept as ``ema`` on
    each of its bucket states; starts equal to the weights as they are now."""

    def __init__(self, optimizer: Any, decay: float, backend: Any) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay: {decay} is not in (0, 1)")
        self.optimizer, self.decay, self.backend = optimizer, decay, backend
        pin = optimizer.grads.device != torch.device("cpu")  # page-locked staging lets the device copy run on its own
        self._staging: list[torch.Tensor] = []
        for st in optimizer.states:
            n = st.span.stop - st.span.start
            dtype = st.master.dtype if st.master is not None else optimizer.model_dtype
            # zeros: the padding past the parameters stays zero (only their ranges are copied)
            self._staging.append(torch.zeros(n, dtype=dtype, pin_memory=pin))
            st.ema = torch.zeros(n, dtype=torch.float32)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portapipe-ema")
        self._pending: Future | None = None
        self.update_s = 0.0
        self.fold_s = 0.0  # the background thread's processor time in the previous step's fold
        self._folded_s = 0.0  # ... in the last fold it finished (set by that thread)
        self.reset()

    # ------------------------------------------------------------------ steps
    def reset(self) -> None:
        """The EMA set to the weights as they are now (a new run, or a checkpoint without one)."""
        self.wait()
        self._stage()
        self.backend.synchronize()
        for st, staged in zip(self.optimizer.states, self._staging):
            st.ema.copy_(staged)

    def update(self) -> None:
        """After an optimizer step: copy the updated weights out and fold them in on the background
        thread; ``update_s``: the training thread's time in it (the wait for the previous fold, the copy out);
        ``fold_s`` then holds the previous step's fold's processor time on the background thread."""
        t0 = time.perf_counter()
        self.wait()
        self.fold_s, self._folded_s = self._folded_s, 0.0
        self._stage()
        done = self.backend.event()
        done.record()
        self._pending = self._pool.submit(self._fold, done)
        self.update_s = time.perf_counter() - t0

    def wait(self) -> None:
        """Wait for the fold in flight (its error, if any, raised here)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _stage(self) -> None:
        opt = self.optimizer
        for bucket, st, staged in zip(opt.grads.buckets, opt.states, self._staging):
            if st.master is not None:
                staged.copy_(st.master, non_blocking=True)
                continue
            # the parameters are the master weights: on the host, their ranges in one call where they
            # tile the span from its start (one kernel on the training thread, not one per parameter)
            segments = bucket.segments(st.span)
            views = [p.detach().reshape(-1)[start : start + n] for p, start, _, n in segments]
            ats = [at for _, _, at, _ in segments]
            end = sum(n for *_, n in segments)
            if views and views[0].device == staged.device and ats == list(itertools.accumulate([0] + [n for *_, n in segments[:-1]])):
                torch.cat(views, out=staged[:end])
                continue
            for view, (_, _, at, n) in zip(views, segments):
                staged[at : at + n].copy_(view, non_blocking=True)

    def _fold(self, done: Any) -> None:
        done.synchronize()  # the copies have landed
        t0 = time.thread_time()  # this thread's processor time: what the fold takes from the host's cores
        with torch.no_grad():
            for st, staged in zip(self.optimizer.states, self._staging):
                st.ema.lerp_(staged.to(torch.float32), 1.0 - self.decay)
        self._folded_s = time.thread_time() - t0

    # ---------------------------------------------------------------- reading
    def host_bytes(self) -> int:
        """Host memory this rank holds for the EMA (the average and its staging buffers)."""
        states = self.optimizer.states
        return sum(st.ema.numel() * st.ema.element_size() for st in states) + sum(t.numel() * t.element_size() for t in self._staging)

    @contextlib.contextmanager
    def swapped_in(self, parameters: list[torch.nn.Parameter]) -> Iterator[None]:
        """Inside: the parameters hold the EMA (cast to the model dtype; collective under zero_stage
        1 / 2); after: the weights they held, as they were."""
        self.wait()
        kept = [p.detach().to("cpu", copy=True) for p in parameters]
        try:
            self.optimizer.refresh(lambda st: st.ema)
            yield
        finally:
            with torch.no_grad():
                for p, t in zip(parameters, kept):
                    p.copy_(t)
