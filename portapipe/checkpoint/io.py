"""Writing and reading checkpoints on the ranks with torch.distributed.checkpoint (DCP).

:class:`Checkpointer` is made once per training run on every rank (collective: it makes a gloo
group of all ranks that only checkpointing uses, so a save in the background never interleaves
with the training's own collectives, whatever the training backend).

- :meth:`Checkpointer.save`: every rank hands DCP its logical share (:func:`.state.capture`: CPU
  copies, taken at once); DCP's save plan writes each key once, one file per rank. Then the ranks
  checksum the files between them and rank 0 writes the manifest and renames the folder into
  place. With ``wait=False`` (the periodic checkpoints) all of that runs on a background thread
  while training goes on: that is DCP's async save (its thread executor runs the same ``save`` on
  a thread), with the checksums and manifest after it on the same thread. The final checkpoint
  and the one written on a stop are written with ``wait=True``.
- :meth:`Checkpointer.load`: DCP's load plan reads exactly the keys this rank holds, from
  whichever files hold them, so any layout reads any other's checkpoint.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import files, state


class _NoCopy:
    """DCP stager for a state dict that is already a private CPU copy: stage it as it is."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


class Checkpointer:
    """Checkpoint saving and loading of one rank of a run (see the module docstring).

    Holds what a checkpoint is made of: the run (``plan``: run id, folder), the config, and this
    rank's runtime (model blocks), optimizer, balancer (or None) and backend (RNG).
    """

    def __init__(self, plan: Any, config: Any, backend: Any, rank: int, world: int, runtime: Any, optimizer: Any, balancer: Any) -> None:
        self.plan, self.config, self.backend = plan, config, backend
        self.runtime, self.optimizer, self.balancer = runtime, optimizer, balancer
        self.root, self.run_id, self.rank, self.world = Path(plan.root), plan.run_id, rank, world
        self.keep = config.checkpoint.keep
        self.group = dist.new_group(backend="gloo")  # CPU tensors only; collective over all ranks
        # The step-boundary check of a save in the background: its own group, since the save's
        # thread runs collectives on self.group at the same time.
        self.poll_group = dist.new_group(backend="gloo")
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.last: Path | None = None

    def layout(self) -> dict[str, Any]:
        """How the run that writes the checkpoint is laid out (any other may read it)."""
        c = self.config
        p, s, b = c.parallel, c.schedule, c.balancer
        return {
            "world_size": self.world, "pp": p.pp, "dp": p.dp, "ep": p.ep, "schedule": s.name,
            "chunks": s.chunks if s.name == "interleaved" else None, "microbatches": s.microbatches,
            "micro_batch_size": c.train.micro_batch_size, "balancer": b.kind, "redundant": b.redundant if b.kind != "none" else 0,
            "backend": self.backend.name, "device_type": self.backend.device_type,
        }

    def restore(self) -> dict[str, Any] | None:
        """Load the plan's checkpoint, if any (collective); its trainer record (progress, schedule)."""
        if self.plan.source is None:
            return None
        path = Path(self.plan.source)
        manifest = files.read_manifest(path)
        self.load(path, self.runtime, self.optimizer, self.balancer, self.backend, self.plan.placement_fits)
        self.last = path if self.plan.mode == "resume" else None
        return manifest["trainer"]

    def save_training(self, step: int, trainer: dict[str, Any], wait: bool = True) -> Path:
        """Checkpoint the training at (1-based) ``step``: model, optimizer, balancer, RNG, ``trainer``."""
        rng = self.backend.get_rng_state() if self.rank == 0 else None  # training draws none; rank 0's stands for all
        share = state.capture(self.runtime, self.optimizer, self.balancer, rng)
        manifest = {"layout": self.layout(), "config": self.config.to_dict(), "trainer": trainer,
                    "parent": None if self.plan.mode != "load" else {"path": self.plan.source, "step": self.plan.step}}
        return self.save(step, share, manifest, wait)

    # ---------------------------------------------------------------------- save
    def save(self, step: int, share: dict[str, Any], manifest: dict[str, Any], wait: bool = True) -> Path:
        """Write checkpoint ``step`` from this rank's ``share`` (from :func:`.state.capture`).

        ``manifest`` is what rank 0 records beside the files (layout, config, trainer state);
        run id, step and checksums are added here. Returns the checkpoint's folder (with
        ``wait=False`` it is complete once :meth:`wait` returns).
        """
        import torch.distributed.checkpoint as dcp

        self.wait()
        share = {**share, "stamp": {str(self.rank): files.stamp_tensor(self.run_id, step, self.rank)}}
        tmp = files.tmp_dir(self.root, step, self.run_id)
        previous = self.last
        t0 = time.perf_counter()
        if wait:
            return self._written(step, tmp, previous, lambda: self._sync_save(dcp, share, step, tmp, manifest, t0))
        upload = self._written(step, tmp, previous, lambda: self._async_save(dcp, share, tmp))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="portapipe-checkpoint")
        self._pending = self._executor.submit(self._written, step, tmp, previous, lambda: self._finish_after(upload, step, tmp, manifest, t0))
        return files.step_dir(self.root, step)

    def _sync_save(self, dcp: Any, share: dict[str, Any], step: int, tmp: Path, manifest: dict[str, Any], t0: float) -> Path:
        tmp.mkdir(parents=True, exist_ok=True)
        dcp.save(share, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=self.group)
        self.last = self._finish(step, tmp, manifest, t0)
        return self.last

    def _async_save(self, dcp: Any, share: dict[str, Any], tmp: Path) -> Future:
        tmp.mkdir(parents=True, exist_ok=True)
        return dcp.async_save(share, storage_writer=dcp.FileSystemWriter(str(tmp)), process_group=self.group, async_stager=_NoCopy())

    def _written(self, step: int, tmp: Path, previous: Path | None, write: Any) -> Any:
        """``write()``; a failure becomes one line (:func:`.files.write_error`) and its temporary folder is removed."""
        try:
            return write()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            error = files.write_error(exc, files.step_dir(self.root, step), previous)
            # DCP fails a save on every rank together. Each rank has looked at the disk (a full
            # one frees up once the partial save is gone) before rank 0 removes it.
            try:
                dist.barrier(group=self.group)
            except Exception:  # noqa: S110  (a peer gone: its error is the one reported)
                pass
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise error from exc

    def poll(self) -> None:
        """At a step boundary (collective): when a save in the background has failed on any rank,
        raise its error on every rank, so that the run stops here rather than at the next save."""
        if self._pending is None:
            return
        done = self._pending.done()
        flags = torch.tensor([int(done and self._pending.exception() is not None), int(not done)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.poll_group)
        failed, running = flags.tolist()
        if failed or not running:
            # DCP fails a save on every rank together: each raises its error here. Finished
            # everywhere: collected now, so that later steps pay for no check.
            self.wait()

    def wait(self) -> Path | None:
        """Wait for a save in the background (raising its error); the newest written checkpoint."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.last = pending.result()
        return self.last

    def close(self, failing: bool = False) -> None:
        """Finish a save in the background; when the run is already failing, do not raise its error too."""
        try:
            self.wait()
        except Exception:
            if not failing:
                raise
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _finish_after(self, upload: Future, step: int, tmp: Path, manifest: dict[str, Any], t0: float) -> Path:
        upload.result()
        return self._finish(step, tmp, manifest, t0)

    def _finish(self, step: int, tmp: Path, manifest: dict[str, Any], t0: float) -> Path:
        """After DCP's save (every rank's file and .metadata written): checksums, manifest, rename."""
        names = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name != files.MANIFEST)
        mine = {n: files.file_digest(tmp / n) for i, n in enumerate(names) if i % self.world == self.rank}
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, mine, group=self.group)
        final = files.step_dir(self.root, step)
        if self.rank == 0:
            digests = {k: v for part in parts for k, v in part.items()}
            record = {"format": files.FORMAT, "run_id": self.run_id, "step": step, **manifest, "files": digests,
                      "save_s": time.perf_counter() - t0, "time": time.time()}
            files.write_json(tmp / files.MANIFEST, record)  # last: only now is the folder a checkpoint
            files.publish(tmp, final)
            files.prune(self.root, self.run_id, self.keep, step)
        dist.barrier(group=self.group)
        return final

    # ---------------------------------------------------------------------- load
    def load(self, path: Path, runtime: Any, optimizer: Any, balancer: Any, backend: Any, placement_fits: bool) -> None:
        """Load checkpoint ``path`` into this rank's model, optimizer, balancer and RNG (collective)."""
        import torch.distributed.checkpoint as dcp

        meta = files.read_dcp_metadata(path)
        reader = dcp.FileSystemReader(str(path))
        if balancer is not None and any(k.startswith("balancer.") for k in meta):
            # The placement first: it decides which experts this rank holds, hence which keys it reads.
            placed = state.balancer_targets(balancer, meta)
            dcp.load(placed, storage_reader=reader, process_group=self.group)
            state.restore_balancer(balancer, placed, placement_fits)
        rng_now = backend.get_rng_state()
        want = state.targets(runtime, optimizer, sorted(rng_now), meta)
        dcp.load(want, storage_reader=dcp.FileSystemReader(str(path)), process_group=self.group)
        state.restore(want, runtime, optimizer)
        if "rng" in want:
            backend.set_rng_state({**rng_now, **want["rng"]})
