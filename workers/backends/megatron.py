"""Megatron-core learner backend: GPTModel from a Hugging Face checkpoint, TP x PP x DP, megatron's optimizer.

Every learner rank calls `make_backend(spec, model_dir)` after joining the default process group
(world = tp * pp * dp, gloo on the CPU, nccl on GPUs); megatron's parallel state is built from that
group. The model is megatron's GPTModel with the local (non-Transformer-Engine) layer spec, loaded
from the Hugging Face weights (`megatron_convert`), wrapped in megatron's DDP, trained by megatron's
non-distributed AdamW with a linear warmup and global-norm clipping. On a CPU-only torch the
compatibility layer (`megatron_compat`) is applied first, and training runs in fp32.

Numerics: log-probs and entropy come from a vocab-parallel log-softmax (two all-reduces over the TP
group, no gathered logits), with megatron's padded vocab rows excluded, so they equal the Hugging Face
model's to fp32 rounding at any TP size. Gradients are summed over micro-batches and DP ranks
(streamrl/losses.py scales each loss so that sum is the step's gradient), as in hf.py.

Schedule and step (the same as hf.py): step k (1-based) uses lr * min(1, k / warmup_steps), then
lr; global-norm clipping to learner.grad_clip; a step whose grad norm is not finite is skipped
(`update_skipped`). Weight decay is megatron's default: none on biases and norm weights.

Pipeline parallelism (pp > 1; `megatron_pipeline`): each stage holds num_layers / pp layers and
megatron's 1F1B schedule moves activations between stages. Only the last stage computes log-probs
and calls the loss; it shares the metrics and log-probs with the other stages so every rank returns
the same values. With pp = 1 a plain loop runs instead (no p2p, no schedule overhead).

Not supported: virtual (interleaved) pipeline stages, the distributed optimizer on CPU, resuming
with a different parallel layout (use `export_hf`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from streamrl import log
from streamrl.config import JobSpec
from streamrl.errors import ConfigError, StreamrlError
from workers.backends import megatron_compat as compat
from workers.backends import megatron_convert as convert
from workers.backends import megatron_pipeline as pipeline
from workers.backends.base import LossFn, MicroBatch, copy_model_folder_files, step_metrics
from workers.backends.vocab_parallel import vocab_parallel_logprobs

logger = log.get_logger("workers.backends.megatron")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MegatronBackendError(StreamrlError):
    """The megatron backend cannot do what was asked (layout, checkpoint mismatch)."""


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return mb
    moved = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
    return MicroBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


def _read_hf_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise MegatronBackendError(f"{model_dir}: no *.safetensors weights (save the model with safetensors)")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def _init_parallel(tp: int, pp: int, dp: int) -> None:
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


class MegatronBackend:
    """One learner rank: the GPTModel shard, megatron's DDP wrapper, optimizer and LR schedule."""

    def __init__(self, spec: JobSpec, model_dir: Path) -> None:
        compat.apply()  # a no-op with CUDA; refuses on an unknown megatron-core on the CPU
        compat.import_megatron()
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        lc = spec.learner
        self.spec, self.model_dir = spec, Path(model_dir)
        self.hf_config: dict[str, Any] = json.loads((self.model_dir / "config.json").read_text())
        self.shape = convert.shape_from_hf_config(self.hf_config)
        if self.shape.num_layers % lc.pp:
            raise ConfigError(
                f"learner.pp: {lc.pp} does not divide the model's {self.shape.num_layers} layers "
                f"(each pipeline stage holds the same number of layers)"
            )
        _init_parallel(lc.tp, lc.pp, lc.dp)
        self.tp, self.tp_rank = lc.tp, ps.get_tensor_model_parallel_rank()
        self.pp, self.pp_rank = lc.pp, ps.get_pipeline_model_parallel_rank()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.pre_process, self.post_process = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        self.stage_layers = self.shape.num_layers // self.pp
        self.first_layer = self.pp_rank * self.stage_layers  # global index of this stage's layer 0
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.rank = dist.get_rank()
        if lc.threads is not None:
            torch.set_num_threads(lc.threads)
        self.is_source = self.rank == 0
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.dtype = _DTYPES[spec.model.dtype]
        else:
            self.device, self.dtype = torch.device("cpu"), torch.float32  # CPU matmuls: fp32 only

        self.vocab_padded = self.shape.padded_vocab(self.tp)
        torch.manual_seed(spec.train.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(spec.train.seed)
        with compat.cuda_to_cpu():
            module = self._build_model()
            self._load_hf(module)
            self.model, self.optimizer, self.scheduler = self._wrap(module)
        self.module = module
        self.steps_done = 0
        logger.info(
            "megatron_backend_ready",
            model=str(self.model_dir),
            tp=self.tp,
            pp=self.pp,
            pp_rank=self.pp_rank,
            dp=self.dp_size,
            device=str(self.device),
            dtype=str(self.dtype),
            params=sum(p.numel() for p in module.parameters()),
        )

    # ------------------------------------------------------------------ construction

    def _transformer_config(self) -> Any:
        from megatron.core.transformer import TransformerConfig

        s, on_cpu = self.shape, self.device.type == "cpu"
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
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            pipeline_dtype=self.dtype,  # of the activations sent between stages
            # micro-batches of a step differ in length and size: send each activation's shape first
            variable_seq_lengths=self.pp > 1,
            moe_token_dispatcher_type="alltoall",  # no MoE; the default refuses variable_seq_lengths
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            fp16=self.dtype == torch.float16,
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

    def _build_model(self) -> Any:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        s = self.shape
        model = GPTModel(
            config=self._transformer_config(),
            transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=s.qk_norm, normalization="RMSNorm"),
            vocab_size=self.vocab_padded,
            max_sequence_length=s.max_position_embeddings,
            parallel_output=True,  # keep logits vocab-sharded; the log-softmax reduces across TP
            share_embeddings_and_output_weights=s.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(s.rope_theta) if float(s.rope_theta).is_integer() else s.rope_theta,  # type: ignore[arg-type]
            rope_scaling=s.llama3_rope_scaling is not None,
            rope_scaling_factor=s.llama3_rope_scaling or 8.0,
            pre_process=self.pre_process,
            post_process=self.post_process,
        )
        return model.to(self.device)

    def _load_hf(self, module: torch.nn.Module) -> None:
        full = convert.hf_to_megatron(_read_hf_weights(self.model_dir), self.shape, self.tp)
        full = convert.stage_tensors(
            full, self.shape, self.first_layer, self.stage_layers, self.pre_process, self.post_process
        )
        mine = convert.shard(full, self.tp_rank, self.tp)
        expected = {k for k in module.state_dict() if not k.endswith("_extra_state")}
        if set(mine) != expected:
            raise MegatronBackendError(
                f"{self.model_dir}: converted weights do not match the megatron model: "
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

    def _wrap(self, module: torch.nn.Module) -> tuple[Any, Any, Any]:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        lc = self.spec.learner
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
                bf16=self.dtype == torch.bfloat16,
                fp16=self.dtype == torch.float16,
                params_dtype=self.dtype,
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

    # ------------------------------------------------------------------ forward

    def _stage_forward(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """This stage's output: logits [b, T, V/tp] on the last stage, else hidden states [T, b, h]
        (a stage after the first reads its input from the previous stage, set by the schedule)."""
        ids = mb.input_ids.to(self.device)
        real = mb.attention_mask.to(self.device, torch.bool)
        b, t = ids.shape
        positions = torch.arange(t, device=self.device).expand(b, t)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=self.device))
        masked = ~(causal[None, None] & real[:, None, None, :])  # [b, 1, T, T], True = not attended
        return model(input_ids=ids, position_ids=positions, attention_mask=masked)  # type: ignore[no-any-return]

    def _forward(self, mb: MicroBatch, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """logprobs [b, T] (graph attached if grad is enabled) and entropy [b, T] (graph attached
        only if `entropy_grad`), on the backend's device; column 0 and padding are 0. pp = 1 only."""
        return self._logprobs_from_logits(self._stage_forward(self.model, mb), mb, entropy_grad)

    def _logprobs_from_logits(
        self, logits: torch.Tensor, mb: MicroBatch, entropy_grad: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [b, T, V/tp] -> logprobs [b, T], entropy [b, T] (see `_forward`)."""
        ids = mb.input_ids.to(self.device)
        real = mb.attention_mask.to(self.device, torch.bool)
        b, t = ids.shape
        per_rank = self.vocab_padded // self.tp
        start = self.tp_rank * per_rank
        valid = max(0, min(per_rank, self.shape.vocab_size - start))  # megatron's padded rows dropped
        logits = logits[:, :-1, :valid].float()  # [b, T-1, valid]: position t predicts token t+1
        lp, ent = vocab_parallel_logprobs(
            logits.reshape(b * (t - 1), valid),
            ids[:, 1:].reshape(-1),
            start,
            self.tp_group if self.tp > 1 else None,
            entropy_grad,
        )
        zero = lp.new_zeros(b, 1)
        keep = real[:, 1:]
        logprobs = torch.cat([zero, lp.view(b, t - 1).masked_fill(~keep, 0.0)], dim=1)
        entropy = torch.cat([zero, ent.view(b, t - 1).masked_fill(~keep, 0.0)], dim=1)
        return logprobs, entropy if entropy_grad else entropy.detach()

    def logprobs_and_entropy(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, T] log-probs and entropy under the current weights, no grad, on the CPU (on every
        rank: with pp > 1 the last stage computes them and broadcasts them over the pipeline)."""
        if self.pp == 1:
            with torch.no_grad():
                lp, ent = self._forward(mb)
            return lp.cpu(), ent.cpu()

        def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, None]:
            m = next(data)
            out = self._stage_forward(model, m)
            if not self.post_process:
                return out, None
            return torch.stack(self._logprobs_from_logits(out, m, False)), None  # [2, b, T], kept

        with torch.no_grad():
            stored = pipeline.run_schedule(self.model, [_to_device(mb, self.device)], forward_step, True)
            both = stored[0] if self.post_process else torch.empty(2, *mb.input_ids.shape, device=self.device)
            both = pipeline.from_last_stage_tensor(both, self.pp_group, self.pp)
        return both[0].cpu(), both[1].cpu()

    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """[b, T] log-probs of `mb.input_ids` under the current weights, no grad (proximal policy)."""
        return self.logprobs_and_entropy(mb)[0]

    # ------------------------------------------------------------------ training

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward each micro-batch (gradients accumulate in DDP's buffer; with pp > 1 through
        megatron's pipeline schedule, the loss called on the last stage), finalise gradients (DP sum and
        the rest, below), then, if the global grad norm is finite, one LR-schedule step, clipping and
        AdamW. Every rank returns the same metrics. A rank with no micro-batches still joins the
        collectives (it contributes zero gradients); all stages of a pipeline get the same micro-batches."""
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads

        t0 = time.perf_counter()
        entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", False))
        per_mb: list[dict[str, float]] = []
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.pp == 1:
            for mb in micro_batches:
                mb_dev = _to_device(mb, self.device)
                logprobs, entropy = self._forward(mb_dev, entropy_grad)
                loss, metrics = loss_fn(mb_dev, logprobs, entropy)
                loss.backward()
                per_mb.append(metrics)
        else:
            per_mb = self._pipelined_backward(micro_batches, loss_fn, entropy_grad)
        tokens = sum(mb.num_tokens for mb in micro_batches)
        with compat.cuda_to_cpu():  # the optimizer's norm, clip and scale scalars say device='cuda'
            # Megatron's gradient finalisation: the DP all-reduce (a sum: see calculate_per_token_loss),
            # the TP sum of replicated weights that see only their rank's heads (Qwen3's q/k norms),
            # and the sum of the tied embedding's two copies on the first and last pipeline stage.
            # num_tokens=None: losses arrive pre-scaled, gradients must not be divided by a count.
            finalize_model_grads([self.model], num_tokens=None)
            # The norm is taken once before the step so a non-finite one skips the update (and the
            # schedule) instead of writing NaNs; megatron's FP32 optimizer has no such check.
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            skipped = not math.isfinite(grad_norm)
            if skipped:
                logger.warning("update_skipped", step=self.steps_done, grad_norm=grad_norm)
            else:
                self.scheduler.step(1)  # this step's lr: lr * min(1, k / warmup) for step k = 1, 2, ...
                ok, _, _ = self.optimizer.step()
                if not ok:
                    raise MegatronBackendError("megatron's optimizer refused a step with a finite grad norm")
            lr = float(self.optimizer.param_groups[0]["lr"])
        self.steps_done += 1
        seconds = time.perf_counter() - t0
        return step_metrics(
            per_mb, grad_norm=grad_norm, lr=lr, skipped=skipped, tokens=tokens, seconds=seconds
        )

    def _pipelined_backward(
        self, micro_batches: list[MicroBatch], loss_fn: LossFn, entropy_grad: bool
    ) -> list[dict[str, float]]:
        """Forward/backward of every micro-batch through megatron's 1F1B schedule (gradients
        accumulate in DDP's buffer); returns the last stage's per-micro-batch metrics on every stage."""

        def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            out = self._stage_forward(model, mb)
            if not self.post_process:
                return out, None  # the schedule sends it to the next stage
            logprobs, entropy = self._logprobs_from_logits(out, mb, entropy_grad)

            def loss_func(lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
                loss, metrics = loss_fn(mb, lp, entropy)
                # the token count only feeds megatron's per-token scaling, which train_step skips
                return loss, torch.tensor(mb.num_tokens, dtype=torch.int), metrics

            return logprobs, loss_func

        mbs = [_to_device(mb, self.device) for mb in micro_batches]
        per_mb = pipeline.run_schedule(self.model, mbs, forward_step, False)
        return pipeline.from_last_stage_objects(per_mb, self.pp_group, self.pp, self.device)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ weights out

    def _gathered(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(megatron name, full tensor) on TP rank 0 of DP replica 0; other ranks join the gathers."""
        for name, t in self.module.state_dict().items():
            if name.endswith("_extra_state"):
                continue
            t = t.detach()
            if self.tp == 1:
                yield name, t
                continue
            if convert.tp_split_dim(name) is None:
                if self.tp_rank == 0:
                    yield name, t
                continue
            t = t.contiguous()
            parts = [torch.empty_like(t) for _ in range(self.tp)] if self.tp_rank == 0 else None
            dist.gather(t, parts, group=self.tp_group, group_dst=0)
            if parts is not None:
                yield name, convert.unshard(name, parts)

    def _shipped(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`_gathered` less the last stage's copy of tied embeddings (the first stage's is sent)."""
        for name, t in self._gathered():
            if not (name == "output_layer.weight" and self.shape.tie_word_embeddings):
                yield name, t

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under Hugging Face names (megatron state-dict order, q/k/v and gate/up split,
        stage after stage), yielded on the source rank only; every rank of DP replica 0 takes part
        (TP gathers, then each later stage sends its tensors to the source). Tensors may be views of
        the live parameters: copy them if they must outlive the next `train_step`."""
        if self.dp_rank != 0:
            return
        local_shapes = [
            (name, t.shape, t.dtype)
            for name, t in self.module.state_dict().items()
            if not name.endswith("_extra_state")
            and not (name == "output_layer.weight" and self.shape.tie_word_embeddings)
        ]
        stages = pipeline.stage_weights(
            self._shipped,
            local_shapes,
            tp=self.tp,
            tp_rank=self.tp_rank,
            pp=self.pp,
            pp_rank=self.pp_rank,
            first_layer=self.first_layer,
            group=self.pp_group,
            device=self.device,
        )
        for name, full in stages:
            hf = convert.megatron_to_hf({name: full}, self.shape)
            if self.is_source:
                yield from hf.items()

    def export_hf(self, directory: Path) -> None:
        """config.json, model.safetensors and the source model's tokenizer files, written by the source rank."""
        from safetensors.torch import save_file

        directory = Path(directory)
        tensors = {name: t.detach().cpu().contiguous().clone() for name, t in self.hf_weights()}
        if self.is_source:
            directory.mkdir(parents=True, exist_ok=True)
            copy_model_folder_files(self.model_dir, directory)
            cfg = dict(self.hf_config)
            dtype = str(self.dtype).removeprefix("torch.")
            cfg["dtype"] = dtype
            if "torch_dtype" in cfg:
                cfg["torch_dtype"] = dtype
            (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        dist.barrier()

    # ------------------------------------------------------------------ checkpoints

    def _layout(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp_size,
            "world": dist.get_world_size(),
            "dtype": str(self.dtype),
        }

    def save(self, directory: Path) -> None:
        """Per-rank file: model shard, optimizer and scheduler state, RNG states, step count (same layout to load)."""
        from megatron.core import tensor_parallel

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            "model": {k: v for k, v in self.module.state_dict().items() if not k.endswith("_extra_state")},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "rng_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
            "steps_done": self.steps_done,
        }
        path = directory / f"megatron_rank{self.rank:05d}.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        if self.rank == 0:
            (directory / "megatron_layout.json").write_text(json.dumps(self._layout()) + "\n")
        dist.barrier()

    def load(self, directory: Path) -> None:
        from megatron.core import tensor_parallel

        directory = Path(directory)
        layout_file = directory / "megatron_layout.json"
        if not layout_file.is_file():
            raise MegatronBackendError(
                f"{directory}: not a megatron learner checkpoint (no megatron_layout.json)"
            )
        saved = json.loads(layout_file.read_text())
        if saved != self._layout():
            raise MegatronBackendError(
                f"{directory}: written with layout {saved}, this run is {self._layout()}; "
                f"resume with the same tp/pp/dp, or export_hf and start from the exported model"
            )
        state = torch.load(
            directory / f"megatron_rank{self.rank:05d}.pt", map_location=self.device, weights_only=True
        )
        with torch.no_grad():
            params = dict(self.module.named_parameters())
            for name, t in state["model"].items():
                params[name].copy_(t)
        with compat.cuda_to_cpu():
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["rng_cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker"])
        self.steps_done = int(state["steps_done"])
        dist.barrier()


def make_backend(spec: JobSpec, model_dir: Path | str) -> MegatronBackend:
    """The megatron learner for this rank (torch.distributed must already be initialised)."""
    return MegatronBackend(spec, Path(model_dir))
