"""The ``train`` section: steps, batch, the optimizer and its learning-rate schedule, precision,
the objective's extra terms and their weights."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .section import Section


class LrPhase(Section):
    """One phase of ``train.lr_schedule`` (:mod:`portapipe.optim.lr_schedule`)."""

    kind: Literal["warmup", "constant", "cosine", "linear"] = Field(
        description="warmup: linear from 0; constant; cosine: a half cosine from where the phase before ended; linear: a straight line from there"
    )
    steps: int = Field(ge=1, description="optimizer steps the phase runs")
    lr: float | None = Field(
        None, ge=0, description="the learning rate the phase ends at [warmup: train.lr; constant: where the phase before ended; cosine, linear: required]"
    )

    @model_validator(mode="after")
    def _needs_lr(self) -> "LrPhase":
        if self.lr is None and self.kind in ("cosine", "linear"):
            raise ValueError(f"a {self.kind} phase needs lr: the learning rate it ends at")
        return self


class TrainConfig(Section):
    steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(4, ge=1, description="sequences per micro-batch per data-parallel rank")
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(3e-4, ge=0)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's betas, each in [0, 1)")
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    seed: int = 1234
    lr_schedule_steps: int | None = Field(
        None,
        ge=1,
        description="step at which a cosine decay reaches min_lr, min_lr after it; unset: no decay (lr after the warm-up), "
        "so the schedule never depends on train.steps; a resumed or loaded run keeps its checkpoint's unless this is set",
    )
    lr_schedule: list[LrPhase] | None = Field(
        None,
        description="the learning rate as phases laid end to end, each {kind, steps, lr}, starting at lr (warmup, constant, "
        "cosine, linear; portapipe.optim.lr_schedule); replaces warmup_steps, min_lr and lr_schedule_steps; after the last "
        "phase its lr stays; a resumed or loaded run keeps its checkpoint's unless this or lr_schedule_steps is set",
    )

    master_dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the master weights, the gradient accumulation and AdamW's state; auto: float32 when "
        "model.dtype is bfloat16 or float16, else model.dtype",
    )
    moments_dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype AdamW's two moments are stored in (Megatron-Core's exp_avg_dtype / exp_avg_sq_dtype; DeepSeek-V3: "
        "bfloat16); the update is computed in the more precise of it and the master dtype; auto: the master dtype",
    )
    grad_reduce_dtype: Literal["auto", "float32", "float64", "bfloat16", "float16"] = Field(
        "auto", description="dtype gradients are summed over the data-parallel replicas in; auto: the master dtype"
    )
    max_skipped_steps: int = Field(
        20, ge=1,
        description="model.dtype float16: this many steps in a row skipped for overflowing gradients stop the run as diverged "
        "(exit 3); the loss scale halves at each, from 2^16 to its floor 1 in 16",
    )
    loss_scale_growth_interval: int = Field(
        2000, ge=1,
        description="model.dtype float16: this many applied steps in a row without an overflow double the loss scale "
        "(torch.amp.GradScaler's default)",
    )
    zero_stage: Literal[0, 1, 2] = Field(
        0,
        description="0: every replica holds the whole optimizer; 1: master weights and AdamW state sharded over the "
        "replicas, updated parameters all-gathered; 2: gradients also reduce-scattered into the shards",
    )
    ema_decay: float | None = Field(
        None, gt=0, lt=1,
        description="keep an exponential moving average of the weights in host memory (float32, sharded like the master "
        "weights), updated after each step on a background thread: ema = decay x ema + (1 - decay) x weights; saved in "
        "checkpoints, exported with portapipe export --ema, validated beside the weights (val_loss_ema); none: not kept",
    )
    optimizer_offload: Literal["off", "swap"] = Field(
        "off",
        description="swap: the master weights and both AdamW moments (optimizer_offload_fraction of them) live in page-locked "
        "host memory; before the optimizer step they stream to the device bucket by bucket on a copy stream while earlier "
        "buckets update, and stream back after, so the device holds at most two buckets of them; the update runs on the "
        "device as without it, bit for bit (MindSpeed's --swap-optimizer, Megatron-Core's --optimizer-cpu-offload)",
    )
    optimizer_offload_fraction: float = Field(
        1.0, gt=0, le=1,
        description="the share of this rank's optimizer state that train.optimizer_offload: swap keeps on the host: whole "
        "gradient buckets in the order the step updates them, the fewest reaching the share (train.grad_bucket_mb sets the "
        "grain; Megatron-Core's --optimizer-offload-fraction)",
    )
    grad_bucket_mb: float = Field(25.0, gt=0, description="size of one gradient bucket (MB of master-dtype gradients)")
    overlap_grad_sync: bool = Field(
        True, description="reduce a block's gradient buckets as soon as its last backward of the step ran (false: all after the schedule)"
    )
    mtp_loss_weight: float | dict[int, float] = Field(
        0.3,
        description="lambda: the multi-token prediction losses enter as lambda / D x their sum; a number, or a schedule "
        "{step: weight} from step 0 on (DeepSeek-V3: 0.3, then 0.1 for the last third); used with model.mtp_layers > 0",
    )
    seq_aux_loss_weight: float = Field(
        0.0,
        ge=0,
        le=1e4,
        description="alpha of DeepSeek-V3's complementary sequence-wise balance loss, added for every MoE layer "
        "(alpha x sum_i f_i P_i per sequence; DeepSeek-V3: 0.0001); 0 = not computed; at most 1e4",
    )
    fp8: Literal["off", "deepseek"] = Field(
        "off",
        description="deepseek: DeepSeek-V3's FP8 recipe (model.dtype bfloat16, float32 master): the three GEMMs of every "
        "attention projection, dense FFN and shared / routed expert Linear whose widths are multiples of 128 in E4M3 "
        "(1x128 activation tiles, 128x128 weight blocks, power-of-two scales), the routed experts' rows dispatched in FP8; "
        "the backend's FP8 matmul runs them (capabilities.fp8_matmul); see docs/fp8.md",
    )

    @field_validator("fp8", "optimizer_offload", mode="before")
    @classmethod
    def _fp8_yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False.
        return "off" if v is False else v

    @field_validator("lr_schedule", mode="before")
    @classmethod
    def _phases_listed(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, list):
            raise ValueError("expected a list of phases, each {kind, steps, lr}")
        return v

    @field_validator("lr_schedule")
    @classmethod
    def _phases_given(cls, v: Any) -> Any:
        if v is not None and not v:
            raise ValueError("an empty schedule; give one phase at least, e.g. [{kind: constant, steps: 1}], or remove it")
        return v

    @field_validator("mtp_loss_weight", mode="before")
    @classmethod
    def _mtp_weight_typed(cls, v: Any) -> Any:
        # before pydantic's union, whose lax mode would take "0.3", true and {"0": "0.3"}, and whose
        # message for .nan or {0.5: 0.3} would not say what is wrong
        if isinstance(v, dict):
            if v and all(w is None for w in v.values()) and all(isinstance(k, float) for k in v):
                raise ValueError(
                    f"read as {v}: YAML 1.1 reads step:weight without a space as one base-60 number; "
                    "write a space after each colon, e.g. {0: 0.3, 10: 0.1}")
            out = {}
            for step, w in v.items():
                if isinstance(step, str) and step.isdigit():  # JSON's keys are text (a config written back, a checkpoint's)
                    step = int(step)
                if isinstance(step, bool) or not isinstance(step, int):
                    raise ValueError(f"step {step!r} is not a whole number >= 0; the schedule is {{step: weight}}, e.g. {{0: 0.3, 10: 0.1}}")
                out[step] = _loss_weight(w, f"the weight of step {step}")
            return out
        return _loss_weight(v, "the weight")

    @field_validator("mtp_loss_weight")
    @classmethod
    def _mtp_weight_in_range(cls, v: Any) -> Any:
        if isinstance(v, dict):
            if not v:
                raise ValueError("an empty schedule; give a weight for step 0 at least, e.g. {0: 0.3}")
            if min(v) != 0:
                raise ValueError(f"the schedule starts at step {min(v)}; it must give the weight from step 0 (e.g. {{0: 0.3, {min(v)}: ...}})")
        return v

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        # torch.optim.AdamW's own rule, checked here so that ranks never start with it.
        bad = [f"betas[{i}] = {b:g}" for i, b in enumerate(v) if not 0.0 <= b < 1.0]
        if bad:
            raise ValueError(f"{', '.join(bad)} is outside [0, 1), as AdamW requires")
        return v


#: the largest weight a loss term may have: 1e4 times the main loss's (DeepSeek-V3's are 0.3 and 1e-4); the
#: weight scales the term's gradient seed in the model's dtype, where 1e308 cannot be held at all
MAX_LOSS_WEIGHT = 1e4


def _loss_weight(w: Any, what: str) -> float:
    """A loss term's weight as the config gives it: a finite number in [0, MAX_LOSS_WEIGHT], never a
    string or a boolean (YAML's quotes and true would otherwise be read as numbers)."""
    if isinstance(w, bool) or not isinstance(w, (int, float)):
        raise ValueError(f"{what} {w!r} is not a number; write it unquoted, e.g. 0.3")
    if not (0 <= w <= MAX_LOSS_WEIGHT):  # nan fails both
        raise ValueError(f"{what} {w!r} is not a finite number >= 0 and <= {MAX_LOSS_WEIGHT:g}")
    return float(w)
