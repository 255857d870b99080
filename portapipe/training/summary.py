"""The run's progress (what a checkpoint carries besides weights) and the summary a run ends with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..metrics.log import strict


@dataclass
class Progress:
    """Steps, tokens, seconds and losses so far. A resumed run continues its checkpoint's, so its
    summary covers the whole run; a loaded run (``checkpoint.load``) is a new run from the
    checkpoint's step: its summary covers its own steps (:meth:`restored`)."""

    step: int = 0
    first_loss: float | None = None
    tokens: int = 0
    train_s: float = 0.0
    losses: list[float] = field(default_factory=list)

    @classmethod
    def restored(cls, trainer: dict[str, Any] | None, mode: str) -> Progress:
        """From a checkpoint's trainer record (None: a new run); ``mode`` the run plan's."""
        if trainer is None:
            return cls()
        kept = cls(**trainer["progress"])
        return kept if mode == "resume" else cls(step=kept.step)

    def record(self, step: int, loss: float | None, tokens: int, seconds: float) -> None:
        """Step ``step`` done; ``loss`` None for a step that was not applied (float16's skipped
        steps: their losses may be inf or nan, and describe no model the run kept)."""
        self.step = step
        self.tokens += tokens
        self.train_s += seconds
        if loss is not None:
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.losses.append(loss)

    def checkpoint(self) -> dict[str, Any]:
        """What a checkpoint keeps (the summary needs only the last losses)."""
        return {"step": self.step, "first_loss": self.first_loss, "tokens": self.tokens, "train_s": self.train_s, "losses": self.losses[-5:]}


def run_summary(config: Any, run: Any, start: int, progress: Progress, validation: dict[str, Any], position: dict[str, Any],
                figures: dict[str, Any], closing: dict[str, Any], ended: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    """The summary line, strict JSON: the run (id, layout, where it started from), its losses (this
    run's own steps: a loaded run's parent's are not among them), the ``validation`` losses, the data
    ``position``, tokens and time, the step ``figures``' medians, ``closing`` (overflows, the files
    written), and how it ``ended`` early ("stopped" / "diverged", with the record saying why). A
    restarted run says where its first launch started from, and how many restarts it took."""
    tail = progress.losses[-5:]
    first = run.first or {"mode": run.mode, "source": run.source, "step": start}
    summary = {
        "run_id": run.run_id,
        "schedule": config.schedule.name,
        "pp": config.parallel.pp,
        "ep": config.parallel.ep,
        "dp": config.parallel.dp,
        "steps": config.train.steps,
        "resumed_from": first["step"] if first["mode"] == "resume" else None,
        "loaded_from": first["source"] if first["mode"] == "load" else None,
        "restarts": run.restarts,
        "first_loss": progress.first_loss,
        "final_loss": progress.losses[-1] if progress.losses else None,
        "final_loss_avg5": sum(tail) / len(tail) if tail else None,
        **validation,
        **position,
        "tokens": progress.tokens,
        "train_s": progress.train_s,
        "tokens_per_s": progress.tokens / progress.train_s if progress.train_s else None,
        **figures,
        **closing,
    }
    if ended is not None:
        summary[ended[0]] = ended[1]
    return strict(summary)
