"""Building one megatron learner rank from a Hugging Face folder: parallel state, GPTModel, weights, optimizer.

`MegatronBackend.__init__` calls these in order: `init_parallel` (megatron's TP x PP x DP state over
the already-initialised default group), `build_model` (GPTModel with the local, non-Transformer-Engine
layer spec, configured by `transformer_config` from the Hugging Face `config.json` shape),
`load_hf_weights` (the safetensors converted by `megatron_convert`, cut to this stage and TP shard),
and `wrap` (megatron's DDP, non-distributed AdamW and the linear-warmup LR schedule). They take plain
values rather than the backend so that each step's inputs are visible at the call site.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from streamrl.config import LearnerConfig
from streamrl.errors import ConfigError, StreamrlError
from workers.backends import megatron_convert as convert

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MegatronBackendError(StreamrlError):
    """The megatron backend cannot do what was asked (layout, checkpoint mismatch)."""


def read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise MegatronBackendError(f"{model_dir}: no *.safetensors weights (save the model with safetensors)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def init_parallel(tp: int, pp: int, dp: int) -> None:
    """Megatron's parallel state over the already-initialised default group."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise MegatronBackendError("megatron backend: torch.distributed is not initialised (init it first)")
    world = dist.get_world_size()
    if world != tp * pp * dp:
        raise ConfigError(
            f"learner: tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp}, but the world has {world} ranks"
        )
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
        if have != (tp, pp):
            raise MegatronBackendError(f"megatron parallel state already initialised with (tp, pp) = {have}")
        return
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)


def transformer_config(s: convert.ModelShape, tp: int, pp: int, dtype: torch.dtype, on_cpu: bool) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=s.num_layers,
        hidden_size=s.hidden_size,
        num_attention_heads=s.num_heads,
        num_query_groups=s.num_query_groups,
        kv_channels=s.head_dim,
        ffn_hidden_size=s.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=s.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=s.qkv_bias,
        qk_layernorm=s.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=dtype,  # of the activations sent between stages
        # micro-batches of a step differ in length and size: send each activation's shape first
        variable_seq_lengths=pp > 1,
        moe_token_dispatcher_type="alltoall",  # no MoE; the default refuses variable_seq_lengths
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=on_cpu,
        # Initialisation is wasted (the checkpoint overwrites it), but megatron sets the
        # tensor-parallel attributes of weights only inside its init functions; without them
        # the grad norm (and so clipping) counts every TP-sharded weight on TP rank 0 only.
        perform_initialization=True,
        # Fused kernels need Transformer Engine / Apex (absent here, and CUDA-only):
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        # Losses arrive pre-normalised (streamrl/losses.py: their sum over micro-batches and DP
        # ranks is the step's loss), so DDP must sum gradients over DP ranks, not average them;
        # this flag is what makes megatron's DDP skip its 1/dp pre-scaling.
        calculate_per_token_loss=True,
        cuda_graph_scope=[],  # megatron's default ("full") warns that it is deprecated
    )


def build_model(
    s: convert.ModelShape,
    config: Any,
    vocab_padded: int,
    pre_process: bool,
    post_process: bool,
    device: torch.device,
) -> Any:
    """This pipeline stage's GPTModel (TransformerConfig `config`), randomly initialised, on `device`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=s.qk_norm, normalization="RMSNorm"),
        vocab_size=vocab_padded,
        max_sequence_length=s.max_position_embeddings,
        parallel_output=True,  # keep logits vocab-sharded; the log-softmax reduces across TP
        share_embeddings_and_output_weights=s.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(s.rope_theta) if float(s.rope_theta).is_integer() else s.rope_theta,  # type: ignore[arg-type]
        rope_scaling=s.llama3_rope_scaling is not None,
        rope_scaling_factor=s.llama3_rope_scaling or 8.0,
        pre_process=pre_process,
        post_process=post_process,
    )
    return model.to(device)


def load_hf_weights(
    module: torch.nn.Module,
    model_dir: Path,
    s: convert.ModelShape,
    *,
    tp: int,
    tp_rank: int,
    first_layer: int,
    stage_layers: int,
    pre_process: bool,
    post_process: bool,
) -> None:
    """Copy this stage's TP shard of the Hugging Face weights in `model_dir` into `module`."""
    full = convert.hf_to_megatron(read_hf_weights(model_dir), s, tp)
    full = convert.stage_tensors(full, s, first_layer, stage_layers, pre_process, post_process)
    mine = convert.shard(full, tp_rank, tp)
    expected = {k for k in module.state_dict() if not k.endswith("_extra_state")}
    if set(mine) != expected:
        raise MegatronBackendError(
            f"{model_dir}: converted weights do not match the megatron model: "
            f"missing {sorted(expected - set(mine))[:5]}, unexpected {sorted(set(mine) - expected)[:5]}"
        )
    with torch.no_grad():
        params = dict(module.named_parameters())
        for name, t in mine.items():
            dst = params[name]
            if dst.shape != t.shape:
                raise MegatronBackendError(
                    f"{name}: checkpoint shard {tuple(t.shape)}, model {tuple(dst.shape)}"
                )
            dst.copy_(t)


def wrap(module: torch.nn.Module, lc: LearnerConfig, dtype: torch.dtype) -> tuple[Any, Any, Any]:
    """(megatron DDP around `module`, its AdamW optimizer, the LR/WD scheduler) from the learner config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp = DistributedDataParallel(
        config=module.config,  # type: ignore[attr-defined]
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module=module,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=lc.lr,
            min_lr=lc.lr,
            weight_decay=lc.weight_decay,
            adam_beta1=lc.adam_beta1,
            adam_beta2=lc.adam_beta2,
            adam_eps=lc.adam_eps,
            clip_grad=lc.grad_clip,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            params_dtype=dtype,
            use_distributed_optimizer=False,  # its wrapped-param type checks are CUDA-only
        ),
        [ddp],
    )
    warmup = lc.warmup_steps
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0 if warmup else lc.lr,
        max_lr=lc.lr,
        min_lr=lc.lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=warmup + 1,  # constant after warmup; must exceed the warmup
        lr_decay_style="constant",
        start_wd=lc.weight_decay,
        end_wd=lc.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return ddp, opt, sched
