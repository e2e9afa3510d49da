"""Job specs: the typed schema of a `job.yaml`.

Every section is a msgspec Struct with `forbid_unknown_fields`, ranges in `Meta`, and tagged unions
for pluggable parts (`type: embedded | code_judge | redis`, ...). Loading, overrides, cross-field
rules and path-qualified errors live in `config_load.py`; this module imports nothing heavy so
`streamrl validate` is instant.

Units: "prompts" are dataset items, "groups" are the n_samples rollouts of one prompt,
"samples"/"trajectories" are single rollouts. Token counts are per trajectory unless stated.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PosFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]
Prob = Annotated[float, Meta(ge=0, le=1)]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class _Variant(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, tag_field="type"):
    pass


# ---------------------------------------------------------------- model and data


class ModelConfig(_Section):
    path: str | None = None
    """Hugging Face model folder. Leave empty with `tiny` set to build streamrl's own tiny model."""
    tiny: Literal["arith", "tool"] | None = None
    """Build (once, cached) the tiny CPU model warm-started on this synthetic task."""
    family: Literal["qwen2", "qwen2.5", "qwen3", "llama"] = "qwen2"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"

    def __post_init__(self) -> None:
        if (self.path is None) == (self.tiny is None):
            raise ValueError("set exactly one of `path` and `tiny`")


class JsonlData(_Variant, tag="jsonl"):
    """RLinf's jsonl: {"prompt": str | [messages], "query_id": ..., "solutions": [answer, ...]}."""

    path: str
    prompt_key: str = "prompt"
    answer_key: str = "solutions"
    id_key: str = "query_id"


class ParquetData(_Variant, tag="parquet"):
    """rStar2/verl parquet: prompt = [messages], reward_model.ground_truth, extra_info.index."""

    path: str


class SyntheticArithData(_Variant, tag="synthetic_arith"):
    """Built-in arithmetic problems for the CPU demo; deterministic given `seed`."""

    size: PosInt = 5000
    digits: Annotated[int, Meta(ge=1, le=9)] = 2
    ops: str = "+"
    seed: int = 0


DataSource = JsonlData | ParquetData | SyntheticArithData


class DataConfig(_Section):
    train: DataSource
    eval: DataSource | None = None
    shuffle: bool = True
    """Visit the training set in a seeded random order, reshuffled each epoch."""
    seed: int = 0
    max_prompt_tokens: PosInt = 2048


# ---------------------------------------------------------------- rollout, RoC, algorithm


class RolloutConfig(_Section):
    agent: Literal["math", "rstar2_tool"] = "math"
    n_samples: PosInt = 8
    """Rollouts per prompt (2G in rStar2 terms); the group RoC down-samples."""
    max_new_tokens: PosInt = 1024
    """Response budget per trajectory, tool-response tokens included."""
    temperature: NonNegFloat = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: int = -1
    max_assistant_turns: PosInt = 5
    max_parallel_calls: PosInt = 1
    max_tool_response_chars: PosInt = 256
    concurrency: PosInt = 64
    """Trajectories in flight per generator process."""


class RocSection(_Section):
    """Resample-on-Correct (rStar2-Agent). Field names follow rStar2's down_sampling_config."""

    enabled: bool = False
    down_sample_to_n: PosInt = 16
    reject_equal_reward: bool = True
    roc_error_ratio: bool = True
    roc_answer_format: bool = True
    min_zero_reward_trace_num: NonNegInt = 2
    min_non_zero_reward_trace_num: NonNegInt = 2
    count_first_turn: bool = False
    """Quirk 1: the reference does not count the first assistant turn in the format penalty."""
    positive_selection: Literal["lowest_penalty", "inverse_penalty"] = "lowest_penalty"
    """Quirk 2: the reference keeps the lowest-penalty positives; the paper samples ~ 1/penalty."""
    negative_selection: Literal["submission_order", "shuffle"] = "submission_order"
    seed: int = 0


class AlgorithmConfig(_Section):
    adv_estimator: Literal["grpo"] = "grpo"
    grpo_eps: PosFloat = 1e-6
    normalize_advantages: bool = False
    """Whiten advantages over the whole batch (token-weighted) after GRPO."""
    clip_low: NonNegFloat = 0.2
    clip_high: NonNegFloat = 0.28
    dual_clip_c: Annotated[float, Meta(gt=1)] | None = 3.0
    log_ratio_clamp: PosFloat = 20.0
    loss_agg: Literal["token-mean", "global-token-mean"] = "token-mean"
    recompute_logprobs: bool = False
    """Recompute proximal log-probs with the learner before the step (decoupled PPO)."""
    behaviour_weight_cap: PosFloat | None = None
    """Truncate pi_prox / pi_behaviour at this value (needs recompute_logprobs)."""
    early_stop_imp_ratio: PosFloat | None = None
    """RLinf: zero a micro-batch's loss when its mean importance ratio exceeds this."""
    kl_coef: NonNegFloat = 0.0
    entropy_coef: NonNegFloat = 0.0


# ---------------------------------------------------------------- buffer, reward, sandbox


class BufferConfig(_Section):
    groups_per_step: PosInt = 8
    """B: groups (after RoC) per train step."""
    max_staleness: Annotated[int, Meta(ge=0, le=64)] = 0
    """eta: a group is trained at most eta policy versions after its prompt was admitted. 0 = sync."""
    max_inflight_prompts: PosInt | None = None
    """Optional hard cap on dispatched-but-unfinished prompts on top of the staleness rule."""
    heartbeat_timeout_s: PosFloat = 60.0
    """A generator silent this long is presumed dead and its prompts are re-dispatched."""
    max_frame_mb: PosInt = 256


class RewardConfig(_Section):
    type: Literal["math_verify", "rstar2_fused", "rlinf_pm5"] = "math_verify"
    workers: PosInt = 2
    timeout_s: PosFloat = 6.0
    default_score: float = 0.0
    """Score given when grading times out or crashes."""
    final_answer_only: bool = False
    """Grade only the last \\boxed{} of the last assistant turn (tool output cannot be credited)."""


class EmbeddedSandbox(_Variant, tag="embedded"):
    max_workers: PosInt = 4
    timeout_s: PosFloat = 4.0
    memory_mb: PosInt = 256
    max_output_chars: PosInt = 1000


class CodeJudgeSandbox(_Variant, tag="code_judge"):
    url: str
    timeout_s: PosFloat = 60.0
    concurrency: PosInt = 8
    batch_size: Annotated[int, Meta(ge=1, le=32)] = 32
    max_retries: PosInt = 4


class RedisSandbox(_Variant, tag="redis"):
    url: str
    workers: NonNegInt = 0
    """Worker processes streamrl starts itself (0: attach to workers started elsewhere)."""
    timeout_s: PosFloat = 4.0
    memory_mb: PosInt = 256


SandboxConfig = EmbeddedSandbox | CodeJudgeSandbox | RedisSandbox


# ---------------------------------------------------------------- engines, learner, weight sync


class EmbeddedEngine(_Variant, tag="embedded"):
    """streamrl's own HF-model server with SGLang's HTTP API (CPU)."""

    count: PosInt = 1
    threads: PosInt = 1
    max_batch: PosInt = 64


class SGLangEngine(_Variant, tag="sglang"):
    urls: list[str] = []
    """Attach to running servers; empty = the launcher starts `count` servers."""
    count: PosInt = 1
    tp_size: PosInt = 1
    mem_fraction_static: Prob = 0.8
    max_running_requests: PosInt | None = None
    extra_args: list[str] = []


EngineConfig = EmbeddedEngine | SGLangEngine


class LearnerConfig(_Section):
    backend: Literal["megatron", "hf"] = "megatron"
    tp: PosInt = 1
    pp: PosInt = 1
    dp: PosInt = 1
    lr: PosFloat = 1e-6
    warmup_steps: NonNegInt = 0
    weight_decay: NonNegFloat = 0.01
    adam_beta1: Prob = 0.9
    adam_beta2: Prob = 0.999
    adam_eps: PosFloat = 1e-8
    grad_clip: PosFloat = 1.0
    micro_batch_tokens: PosInt = 20480
    """Micro-batches are packed up to this many tokens (prompt + response) per data-parallel rank."""
    offload: bool = False
    checkpoint_every: NonNegInt = 0
    """Steps between checkpoints (learner state + buffer snapshot); 0 = only at the end."""
    threads: PosInt | None = None


class WeightSyncConfig(_Section):
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    bucket_mb: PosInt = 512
    pause_mode: Literal["abort", "in_place"] = "abort"
    verify_checksum: bool = False
    timeout_s: PosFloat = 600.0


class LauncherConfig(_Section):
    kind: Literal["local", "ray"] = "local"
    nodes: PosInt = 1
    gpus_per_node: NonNegInt = 0
    generators: PosInt = 1
    on_failure: Literal["stop", "restart"] = "restart"
    max_restarts: NonNegInt = 3
    ray_address: str | None = None


class EvalConfig(_Section):
    every_steps: NonNegInt = 0
    """0 disables periodic evaluation (start and end are still evaluated when eval data is set)."""
    max_prompts: PosInt = 200
    greedy: bool = True
    sampled_n: NonNegInt = 0
    """Samples per prompt for sampled accuracy (0: greedy only)."""
    temperature: NonNegFloat = 1.0


class TrainConfig(_Section):
    steps: PosInt = 100
    seed: int = 0


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"


class JobSpec(_Section):
    name: str
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)
    roc: RocSection = msgspec.field(default_factory=RocSection)
    algorithm: AlgorithmConfig = msgspec.field(default_factory=AlgorithmConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)
    sandbox: SandboxConfig | None = None
    engine: EngineConfig = msgspec.field(default_factory=EmbeddedEngine)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    weight_sync: WeightSyncConfig = msgspec.field(default_factory=WeightSyncConfig)
    launcher: LauncherConfig = msgspec.field(default_factory=LauncherConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    train: TrainConfig = msgspec.field(default_factory=TrainConfig)
    logging: LoggingConfig = msgspec.field(default_factory=LoggingConfig)

    @property
    def group_size(self) -> int:
        """Trajectories per group after RoC (what GRPO normalises over)."""
        return self.roc.down_sample_to_n if self.roc.enabled else self.rollout.n_samples
