"""The configuration's sections: one class per concern, each key documented where it is declared,
with its type, default and bounds (the ``train`` section's in :mod:`.train_section`). Loading and
the checks across sections are in :mod:`.load`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .model_rules import ARCH_DEFAULTS, ARCH_KEYS, model_problems
from .section import Section
from .setup import OFFLOAD_PARTS, RECOMPUTE_PARTS, n_model_blocks, recompute_norms, recompute_segment, split_of
from .train_section import TrainConfig

SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")


class ParallelConfig(Section):
    pp: int = Field(1, ge=1, description="pipeline ranks")
    ep: int = Field(1, ge=1, description="expert-parallel ranks (experts sharded over them)")
    dp: int = Field(1, ge=1, description="data-parallel replicas")
    world_size: int | None = Field(None, ge=1, description="total ranks; must equal pp*ep*dp (default: that product)")
    layers_per_stage: list[int] | dict[str, int] | None = Field(
        None,
        description="layers of each model block (stage: pp of them, 2*pp for dualpipev, pp*chunks for interleaved), adding up "
        "to model.n_layers, the first and the last may hold none; or {first: n, last: m} (Megatron's "
        "--decoder-first/last-pipeline-num-layers), the other blocks near-equal; default: near-equal blocks",
    )

    @field_validator("layers_per_stage", mode="before")
    @classmethod
    def _split_kinds(cls, v: Any) -> Any:
        def count(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 0

        if v is None:
            return v
        if isinstance(v, dict):
            unknown = [k for k in v if k not in ("first", "last")]
            if unknown or not v:
                raise ValueError(f"expected first and / or last as keys, got {unknown or 'none'}")
            if not all(count(x) for x in v.values()):
                raise ValueError("first and last take whole numbers of layers >= 0")
            return v
        if isinstance(v, list) and v and all(count(x) for x in v):
            return v
        raise ValueError("expected a list of whole numbers of layers >= 0, one per model block, or {first: n, last: m}")


class ScheduleConfig(Section):
    name: Literal["1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev"] = "dualpipev"
    microbatches: int = Field(4, ge=1, description="micro-batches per step")
    chunks: int = Field(2, ge=1, description="model chunks per rank for interleaved (VPP)")
    overlap: bool = Field(True, description="run F&B pairs overlapped (all-to-all behind compute)")
    w_split: bool = Field(True, description="split backward into input-grad (B) and weight-grad (W)")
    pair_forwards: bool = Field(
        False,
        description="run consecutive lone forwards of exchanging blocks (the warm-up's) as F&F pairs: one micro-batch's "
        "all-to-all behind the other's compute; the first forward's output leaves after the pair",
    )


class ModelConfig(Section):
    arch: Literal["portapipe", "deepseek_v3", "qwen3_moe"] = Field(
        "portapipe",
        description="portapipe (this project's small DeepSeek-style model), deepseek_v3 (multi-head latent attention, "
        "DeepSeekMoE) or qwen3_moe (grouped-query attention with q/k norm, softmax routing); see docs/models.md",
    )
    init_from: str | None = Field(
        None, description="a Hugging Face model folder (config.json + *.safetensors) to start from; its config must match this section"
    )
    vocab_size: int = Field(256, ge=2, description="byte-level by default")
    hidden: int = Field(64, ge=1)
    n_layers: int = Field(4, ge=1)
    n_dense: int = Field(1, ge=0, description="the first n_dense layers use a dense FFN")
    n_heads: int = Field(4, ge=1)
    ffn_hidden: int = Field(128, ge=1, description="dense FFN width")
    moe_hidden: int = Field(32, ge=1, description="width of one routed expert")
    n_experts: int = Field(8, ge=1, description="routed experts per MoE layer")
    n_shared: int = Field(1, ge=0, description="shared experts per MoE layer [qwen3_moe: 0, it has none]")
    top_k: int = Field(2, ge=1)
    n_groups: int = Field(1, ge=1, description="expert groups for group-limited routing")
    topk_groups: int = Field(1, ge=1, description="groups a token may route to")
    bias_update_speed: float = Field(
        1e-3, ge=0, le=1, description="aux-loss-free bias step per update; at most 1, the whole range of the sigmoid affinities "
        "it is added to (a larger step decides the routing by the bias alone)")
    routed_scale: float = Field(1.0, gt=0, description="routed experts' weights are scaled by it (deepseek_v3: routed_scaling_factor)")
    seq_len: int = Field(64, ge=2)
    dtype: Literal["float32", "float64", "bfloat16", "float16"] = Field(
        "float32", description="compute dtype of weights and activations; bfloat16 / float16 train against master weights (train.master_dtype)"
    )
    init_std: float = Field(0.02, gt=0)
    mtp_layers: int = Field(
        0,
        ge=0,
        description="D: multi-token prediction modules (DeepSeek-V3: 1), after the head on the last stage; module k "
        "predicts token i+k+1 (num_nextn_predict_layers in Hugging Face folders); deepseek_v3 and portapipe; at most seq_len - 1",
    )
    tie_word_embeddings: bool = Field(
        False,
        description="the output head is the embedding (one weight; a copy on the last stage's rank whose gradient is "
        "summed with the first stage's); read from and written to Hugging Face folders",
    )
    norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon (rms_norm_eps)")
    # ---- deepseek_v3: multi-head latent attention
    q_lora_rank: int | None = Field(None, ge=0, description="deepseek_v3: rank of the query's low-rank projection; 0 = a full-rank query [0]")
    kv_lora_rank: int | None = Field(None, ge=1, description="deepseek_v3: rank of the joint key/value compression [32]")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="deepseek_v3: per-head query/key width without RoPE [16]")
    qk_rope_head_dim: int | None = Field(None, ge=2, description="deepseek_v3: per-head query/key width with RoPE (the key's is shared by all heads) [8]")
    v_head_dim: int | None = Field(None, ge=1, description="deepseek_v3: per-head value width [16]")
    rope_interleave: bool | None = Field(None, description="deepseek_v3: RoPE over interleaved pairs of dimensions, as DeepSeek's weights are laid out [true]")
    # ---- qwen3_moe: grouped-query attention
    n_kv_heads: int | None = Field(None, ge=1, description="qwen3_moe: key/value heads, dividing n_heads [n_heads]")
    head_dim: int | None = Field(None, ge=2, description="qwen3_moe: per-head width [hidden / n_heads]")
    # ---- deepseek_v3 and qwen3_moe
    norm_topk_prob: bool | None = Field(None, description="deepseek_v3 / qwen3_moe: normalise the top-k weights to sum 1 [true / false]")
    rope_theta: float | None = Field(None, gt=0, description="deepseek_v3 / qwen3_moe: RoPE base [10000]")
    rope_scaling: dict[str, Any] | None = Field(
        None, description="deepseek_v3 / qwen3_moe: RoPE scaling as in a Hugging Face config; only type yarn (factor, "
        "original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim) [none]"
    )

    @model_validator(mode="before")
    @classmethod
    def _arch_defaults(cls, data: Any) -> Any:
        """Fill the chosen architecture's own keys (and defaults that differ for it) where not given."""
        if not isinstance(data, dict):
            return data
        arch = data.get("arch", "portapipe")
        if arch not in ARCH_KEYS:
            return data
        out = dict(data)
        fields = cls.model_fields
        for key, value in {**ARCH_DEFAULTS.get(arch, {}), **ARCH_KEYS[arch]}.items():
            if out.get(key) is None:
                out[key] = value
        if arch == "qwen3_moe":
            heads = out.get("n_heads", fields["n_heads"].default)
            hidden = out.get("hidden", fields["hidden"].default)
            if out.get("n_kv_heads") is None:
                out["n_kv_heads"] = heads
            if out.get("head_dim") is None and isinstance(heads, int) and isinstance(hidden, int) and heads > 0 and hidden % heads == 0:
                out["head_dim"] = hidden // heads
        return out

    def problems(self) -> list[str]:
        """Rules of this section that depend on the architecture (the rules table's ``architecture``)."""
        return model_problems(self)


class BalancerConfig(Section):
    kind: Literal["none", "eplb", "lplb"] = "none"
    interval: int = Field(50, ge=1, description="eplb: rebalance every N steps")
    window: int = Field(10, ge=1, description="eplb: steps of recorded loads used")
    min_gain: float | Literal["auto"] = Field(
        0.0,
        description="adopt a rebalance only if mean balancedness (mean / max EP-rank load) gains at least "
        "min_gain x the fraction of expert slots whose rows it moves; i.e. the gain a full migration must win; "
        "auto (eplb and lplb): (measured time of a full migration, before the first the replica gradient sum's per byte) / (interval x measured expert time per step)",
    )

    @field_validator("min_gain")
    @classmethod
    def _min_gain_non_negative(cls, v: Any) -> Any:
        if v != "auto" and not v >= 0:
            raise ValueError("expected a number >= 0 or auto")
        return v
    redundant: int = Field(0, ge=0, description="eplb: extra expert slots per EP rank")
    groups: int | None = Field(None, ge=1, description="eplb: expert groups (default: model.n_groups)")
    nodes: int = Field(1, ge=1, description="nodes the EP ranks span (consecutive ranks per node)")
    policy: Literal["incremental", "refined", "hierarchical", "global"] = Field(
        "incremental",
        description="eplb: incremental (first placement refined, then move few slots), refined, hierarchical, global",
    )
    max_moved: float = Field(0.1, gt=0, le=1, description="eplb incremental: at most this fraction of a layer's slots change per rebalance")
    stay_off: bool = Field(
        True,
        description="eplb / lplb: route every token to its expert's first slot (no spread over replicas, no per-batch LP, "
        "no replica gradient sum) while the time the replicas are predicted to save per step (from the measured expert "
        "compute per row) is below what they cost per step (LP, gradient sum; measured)",
    )
    topology: Literal["cube", "hypercube", "ring", "torus"] = "ring"
    torus: tuple[int, int] | None = Field(None, description="lplb: (m, n) for topology torus")


class BenchConfig(Section):
    """Benchmark-only routing: what the balancers are measured against. Both change which experts
    the model uses, so a run with either is a benchmark, not training."""

    router_skew_from: str | None = Field(
        None,
        description="benchmark only: a loads file (text, JSON, .pt; a run's expert_loads.json) with one row per MoE "
        "layer (repeated when shorter) and model.n_experts loads; each token's experts are drawn in proportion to them",
    )
    force_uniform_routing: bool = Field(
        False, description="benchmark only: every token's experts chosen round-robin, so every expert gets the same rows"
    )

    @model_validator(mode="after")
    def _one_source(self) -> "BenchConfig":
        if self.router_skew_from is not None and self.force_uniform_routing:
            raise ValueError("router_skew_from and force_uniform_routing are two routings; set one")
        return self


class MemoryConfig(Section):
    zero_memory: Literal["off", "level0", "level1"] = "off"

    @field_validator("zero_memory", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False.
        return "off" if v is False else v

    zero_memory_layers: int | None = Field(None, ge=1, description="MoE layers per stage using it (default all)")
    recompute: Literal["none", "norms", "moe", "full", "norms+moe"] = Field(
        "none",
        description="what is recomputed in the backward instead of kept: norms (the RMSNorms' outputs and MLA's "
        "up-projected queries, keys and values), moe (an MoE layer after its attention), full (whole layers), or "
        "norms and moe together: the list [norms, moe] (read as norms+moe)",
    )
    recompute_layers: int | None = Field(None, ge=1, description="layers per stage recomputed (default all)")
    fp8_activations: bool = Field(
        False,
        description="with train.fp8: each FP8 Linear keeps its input for the weight gradient as the FP8 values and 1x128 scales "
        "its forward made, and each FFN's activation keeps its input in FP8 and remakes its output in the backward "
        "(DeepSeek-V3's FP8-cached activations; docs/fp8.md)",
    )

    offload: list[Literal[OFFLOAD_PARTS]] = Field(  # type: ignore[valid-type]
        default_factory=list,
        description="the parts whose saved tensors leave for host memory right after their forward (on the copy stream) "
        "and come back one action ahead of their backward: attention (a layer's attention part: norms, attention, "
        "routing), dense (a dense layer's), shared (the shared expert's), experts (the routed experts'); a part's inputs "
        "and outputs stay (other parts hold them); exact, bit for bit (docs/memory.md)",
    )
    offload_layers: int | None = Field(None, ge=1, description="layers per stage whose parts memory.offload names go to the host (default all)")

    @field_validator("offload")
    @classmethod
    def _offload_once(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"each part once; got {v}")
        return [p for p in OFFLOAD_PARTS if p in v]  # one order, whatever the config's

    @field_validator("recompute", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        # A list of parts is one choice: [norms, moe] in either order (full already drops the norms).
        if isinstance(v, (list, tuple)):
            if "full" in v and len(v) > 1:
                raise ValueError(f"full recomputes whole layers, their norms included: write full alone, not {list(v)}")
            if not v or len(set(map(str, v))) != len(v) or not set(v) <= set(RECOMPUTE_PARTS):
                raise ValueError(f"a list of recompute parts holds {' and '.join(RECOMPUTE_PARTS)}, each once; got {list(v)}")
            return "+".join(p for p in RECOMPUTE_PARTS if p in v)
        return v

    @property
    def segment(self) -> str:
        """The segment recomputed from a layer's input: ``none``, ``moe`` or ``full`` (norms apart)."""
        return recompute_segment(self.recompute)

    @property
    def norms(self) -> bool:
        """Whether the norms' outputs and MLA's up-projections are recomputed."""
        return recompute_norms(self.recompute)


class SourceConfig(Section):
    """One source of a blend (``data.sources``, ``data.val_sources``)."""

    path: str = Field(description="a dataset folder (portapipe tokenize), a Megatron prefix (PREFIX.bin + PREFIX.idx) or a token file")
    weight: float = Field(1.0, gt=0, description="its share of the samples, the weights normalised over the sources [1]")
    token_dtype: Literal["auto", "uint16", "uint32"] | None = Field(
        None, description="a flat file's width of one id; auto reads it from the sidecar <path>.json [data.token_dtype]; a dataset "
        "folder's dataset.json or a Megatron index says its own, which this must not contradict"
    )


class DataConfig(Section):
    format: Literal["bytes", "tokens"] = Field(
        "bytes", description="bytes: a text file, one token per byte; tokens: token data (data.path or data.sources): a dataset "
        "folder portapipe tokenize wrote, a Megatron-Core indexed dataset (PREFIX.bin + PREFIX.idx) or a flat file of uint16 / uint32 ids (nanoGPT)"
    )
    path: str | None = Field(None, description="the text (bytes) or the token data (tokens; a blend of one); default for bytes: the corpus shipped with portapipe")
    sources: list[SourceConfig] | None = Field(
        None, description="tokens: a blend, a list of {path, weight}; each step's samples come from the sources in proportion to "
        "the weights (Megatron's rule, see docs/training.md)"
    )
    val_sources: list[SourceConfig] | None = Field(
        None, description="tokens: validation data of its own, a list of {path, weight}; the loss is reported per source "
        "(without it: the last val_fraction of each source)"
    )
    sampling: Literal["auto", "epochs", "random"] = Field(
        "auto", description="epochs: windows of seq_len + 1 tokens laid end to end, each epoch in its own seeded order, no window twice "
        "in an epoch; random: windows at random starts, with replacement (one source); auto: epochs for tokens, random for bytes"
    )
    document_mask: bool = Field(
        False, description="tokens with document boundaries: attention stays inside each document of a sample and positions (RoPE) "
        "restart at each (Megatron's reset_attention_mask + reset_position_ids); the multi-token prediction modules' rows too"
    )
    mask_eos_loss: bool = Field(
        False, description="tokens with document boundaries: leave out of the loss the prediction made at each document's end "
        "(its EOS) of the next document's first token (Megatron's eod_mask_loss); the loss is the mean over the global batch's kept targets; "
        "with model.mtp_layers it needs document_mask"
    )
    allow_changed_sources: bool = Field(
        False, description="resume a checkpoint whose sources (list, weights, files) differ from these; its later batches then differ "
        "from an uninterrupted run's"
    )
    token_dtype: Literal["auto", "uint16", "uint32"] = Field(
        "auto", description="tokens, flat files: width of one id, for data.path and for each source without its own token_dtype; "
        "auto reads it from the sidecar <path>.json (a dataset folder or a Megatron index says its own: with data.path this must "
        "not contradict it, in a blend it applies to flat files alone)"
    )
    vocab_size: int | None = Field(
        None, ge=1, description="tokens: the vocabulary of the tokenizer that wrote the data, at most model.vocab_size "
        "(a model may pad its vocabulary); every id must be below it [the dataset's or the sidecar's]",
    )
    val_fraction: float = Field(0.05, ge=0, lt=1, description="the last fraction of each source held out for validation")


class WandbConfig(Section):
    """``log.wandb``: the metrics as a Weights & Biases run (:mod:`portapipe.metrics.wandb_sink`)."""

    mode: Literal["off", "online", "offline"] = Field(
        "off", description="off; online: to the W&B server (wandb login first); offline: into <log.dir>/wandb/, no network (wandb sync sends it later)"
    )

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as False

    project: str = Field("portapipe", description="the W&B project")
    entity: str | None = Field(None, description="the W&B user or team [wandb's default]")


class StepChoice(Section):
    """Chosen steps of a run, 1-based as metrics.jsonl numbers them."""

    steps: list[int] = Field(default_factory=list, description="the steps (1-based, as metrics.jsonl numbers them)")

    @field_validator("steps", mode="before")
    @classmethod
    def _from_one(cls, v: Any) -> Any:
        if not isinstance(v, list) or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in v):
            raise ValueError("expected a list of steps, whole numbers >= 1 as metrics.jsonl numbers them (step 1 is the first)")
        return v


class TimelineConfig(StepChoice):
    """``log.timeline``: every rank's spans of chosen steps on one clock (:mod:`portapipe.timeline`,
    docs/timeline.md); off unless a step is chosen."""

    every: int = Field(0, ge=0, description="also every N-th step (N, 2N, ...); 0: only those of steps")

    def chosen(self, step: int) -> bool:
        """Whether (1-based) ``step`` is recorded."""
        return step in self.steps or (self.every > 0 and step % self.every == 0)


class ProfilerConfig(StepChoice):
    """``log.profiler``: chosen steps under torch.profiler on chosen ranks, every action and exchange
    a labelled range (:mod:`portapipe.timeline.profiler`); off unless a step is chosen."""

    ranks: list[int] | None = Field(None, description="ranks profiled [all]; the others train on, unprofiled")
    memory: bool = Field(False, description="also record the allocator's memory (torch.profiler's profile_memory)")

    @field_validator("ranks", mode="before")
    @classmethod
    def _ranks(cls, v: Any) -> Any:
        if v is not None and (not isinstance(v, list) or not v or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in v)):
            raise ValueError("expected a non-empty list of ranks >= 0 (or leave it out: every rank)")
        return v


class LogConfig(Section):
    dir: str = "runs/latest"
    every: int = Field(1, ge=1)
    progress: bool = True
    level: Literal["debug", "info", "warning", "error"] = "info"
    tensorboard: bool = Field(
        False, description="also write the metrics as TensorBoard scalars in <dir>/tensorboard/<run id>/ (extra tensorboard)"
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig, description="also log the metrics to a Weights & Biases run named by the run id (extra wandb); "
        "a mode alone (offline) stands for {mode: offline}",
    )
    timeline: TimelineConfig = Field(
        default_factory=TimelineConfig, description="record every rank's actions, exchanges and transfers of chosen steps on one clock: "
        "<dir>/timeline/step_<N>.json (Chrome trace) and step_<N>.rows.json; `portapipe timeline <dir> --step N` draws them",
    )
    profiler: ProfilerConfig = Field(
        default_factory=ProfilerConfig, description="run chosen steps under torch.profiler on chosen ranks, every action and exchange "
        "a labelled range: <dir>/profiler/rank<r>_step<N>.json.gz",
    )

    @field_validator("wandb", mode="before")
    @classmethod
    def _wandb_mode_alone(cls, v: Any) -> Any:
        if v is False or v in ("off", "online", "offline"):
            return {"mode": "off" if v is False else v}
        if not isinstance(v, (dict, WandbConfig)):
            raise ValueError("expected a mode (off, online or offline) or {mode, project, entity}")
        return v


class CheckpointConfig(Section):
    dir: str | None = Field(None, description="default: <log.dir>/checkpoints")
    every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    at_end: bool = Field(
        True, description="write one when the last step is done (false: a run whose end state is not needed, as a benchmark's, "
        "skips it; a stop by SIGINT / SIGTERM still writes one)"
    )
    resume: bool = Field(True, description="continue this log.dir's run from its newest complete checkpoint")
    keep: int = Field(2, ge=1, description="this run's newest checkpoints kept")
    load: str | None = Field(
        None, description="start a new run in log.dir from this checkpoint (or the newest complete one of this folder), step included"
    )
    overwrite: bool = Field(
        False, description="a new run in a folder holding another run's files first moves them aside to <log.dir>/previous/<run id>"
    )


class LaunchConfig(Section):
    """How the local launcher watches, stops and restarts its ranks (not used under torchrun /
    mpirun: their own options do it there), and the cores each rank of a machine runs on (under
    every launcher)."""

    stall_timeout_s: float = Field(
        60.0, ge=0, description="a rank whose heartbeat stops this long (stopped, frozen) is named and the job ended; 0 never"
    )
    stop_grace_s: float = Field(
        60.0, ge=0, description="after SIGINT / SIGTERM, seconds the ranks get to finish their step and checkpoint before they are killed"
    )
    pin_cores: bool | Literal["auto"] = Field(
        False,
        description="bind each rank of a machine to a disjoint set of the cores the launcher may use (its affinity and CPU quota), "
        "one intra-op thread per core of the set; true refuses more ranks on a machine than cores; auto pins where every rank "
        "can have a core and leaves the ranks unpinned otherwise; false: unpinned, each rank runs cores / ranks threads",
    )
    max_restarts: int = Field(
        0, ge=0, description="after a rank dies, raises, stalls or a collective times out, every rank is ended and the job "
        "started again from the run's newest complete checkpoint, at most this many times (within restart_window_s); a config "
        "error, a checkpoint or data file that cannot be read, and a divergence that recurs at the same step are not retried; "
        "0: the first fault ends the run (torchrun's --max-restarts)",
    )
    restart_window_s: float = Field(
        0.0, ge=0, description="max_restarts counts the restarts of the last this many seconds, so a run of weeks that faults "
        "now and then goes on while a crash loop stops; 0: every restart of the launch counts",
    )
    restart_backoff_s: float = Field(
        1.0, ge=0, description="seconds waited before a restart; doubled for each restart in a row that resumes from no later "
        "checkpoint than the one before (a crash loop), at most 300",
    )


class Config(Section):
    backend: str = Field("auto", description="auto | cpu | cuda | npu | a plug-in name")
    backend_options: dict[str, Any] = Field(default_factory=dict)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    balancer: BalancerConfig = Field(default_factory=BalancerConfig)
    bench: BenchConfig = Field(default_factory=BenchConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.world_size if p.world_size is not None else p.pp * p.ep * p.dp

    def n_blocks(self) -> int:
        """Model blocks (contiguous layer slices) the schedule splits the model into."""
        return n_model_blocks(self.schedule.name, self.parallel.pp, self.schedule.chunks)

    def stage_split(self) -> Any:
        """``parallel.layers_per_stage`` in the form the model and the planner take (:data:`portapipe.config.setup.Split`)."""
        return split_of(self.parallel.layers_per_stage)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


