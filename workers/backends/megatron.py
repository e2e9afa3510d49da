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

Layout: construction from the Hugging Face folder is in `megatron_build`; weights out (`hf_weights`,
`export_hf`) and checkpoints (`save`, `load`) are in `megatron_io`; this module holds the rank's state,
the forward pass, log-probs and the training step.
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

from streamrl import log
from streamrl.config import JobSpec
from streamrl.errors import ConfigError
from workers.backends import megatron_build as build
from workers.backends import megatron_compat as compat
from workers.backends import megatron_convert as convert
from workers.backends import megatron_io
from workers.backends import megatron_pipeline as pipeline
from workers.backends.base import LossFn, MicroBatch, step_metrics
from workers.backends.megatron_build import MegatronBackendError
from workers.backends.vocab_parallel import vocab_parallel_logprobs

__all__ = ["MegatronBackend", "MegatronBackendError", "make_backend"]

logger = log.get_logger("workers.backends.megatron")


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return mb
    moved = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb)}
    return MicroBatch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()})


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
        build.init_parallel(lc.tp, lc.pp, lc.dp)
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
            self.dtype = build.DTYPES[spec.model.dtype]
        else:
            self.device, self.dtype = torch.device("cpu"), torch.float32  # CPU matmuls: fp32 only

        self.vocab_padded = self.shape.padded_vocab(self.tp)
        torch.manual_seed(spec.train.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(spec.train.seed)
        with compat.cuda_to_cpu():
            config = build.transformer_config(
                self.shape, self.tp, self.pp, self.dtype, self.device.type == "cpu"
            )
            module = build.build_model(
                self.shape, config, self.vocab_padded, self.pre_process, self.post_process, self.device
            )
            build.load_hf_weights(
                module,
                self.model_dir,
                self.shape,
                tp=self.tp,
                tp_rank=self.tp_rank,
                first_layer=self.first_layer,
                stage_layers=self.stage_layers,
                pre_process=self.pre_process,
                post_process=self.post_process,
            )
            self.model, self.optimizer, self.scheduler = build.wrap(module, lc, self.dtype)
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

    # ------------------------------------------------------------------ weights out and checkpoints

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under Hugging Face names (megatron state-dict order, q/k/v and gate/up split,
        stage after stage), yielded on the source rank only; every rank of DP replica 0 takes part
        (TP gathers, then each later stage sends its tensors to the source). Tensors may be views of
        the live parameters: copy them if they must outlive the next `train_step`."""
        return megatron_io.hf_weights(self)

    def export_hf(self, directory: Path) -> None:
        """config.json, model.safetensors and the source model's tokenizer files, written by the source rank."""
        megatron_io.export_hf(self, directory)

    def save(self, directory: Path) -> None:
        """Per-rank file: model shard, optimizer and scheduler state, RNG states, step count (same layout to load)."""
        megatron_io.save(self, directory)

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote; the tp/pp/dp layout must be the same."""
        megatron_io.load(self, directory)


def make_backend(spec: JobSpec, model_dir: Path | str) -> MegatronBackend:
    """The megatron learner for this rank (torch.distributed must already be initialised)."""
    return MegatronBackend(spec, Path(model_dir))
