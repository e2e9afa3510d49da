"""The plain-torch learner backend: a transformers causal LM, torch AdamW, data parallelism only.

For small models (the CPU demo's tiny Qwen2) and as the numerical reference for the Megatron
backend. Implements `workers.backends.base.Backend`; built by `make_backend(spec, model_dir)`.

Numerics. Parameters, gradients and optimizer state are float32 (master weights). On the CPU the
forward runs in float32 too, whatever `model.dtype` says: that field is the engines' serving dtype,
bfloat16 matmuls on these CPUs are slow, and the log-probs must match an fp32 engine to 1e-4. On
CUDA the forward autocasts to `model.dtype`. Log-probs and entropy always come from a float32
log_softmax of the logits. Dropout is off (eval mode): the ratio compares against the engine's
dropout-free policy. Sequences are right-padded and no attention mask is passed: the model is
causal, so a real token never attends to the padding after it, and padded positions are masked out
of the loss (contract in base.py).

Optimizer. torch AdamW (`learner.lr`, betas, eps, weight decay), with Megatron's default grouping:
no weight decay on biases and 1-D parameters (norms). Learning rate: linear warmup over
`learner.warmup_steps` (step k, from 0, uses lr * (k + 1) / warmup_steps, so the first step already
learns, unlike Megatron's which starts at 0), then constant. Gradients are clipped to
`learner.grad_clip` (global L2 norm); a step whose norm is not finite is skipped (no optimizer or
scheduler step) and reported as `update_skipped`.

Data parallelism. If `torch.distributed` is initialised, every rank of the default group is a DP
rank (`learner.dp` must equal the world size; `learner.tp` and `learner.pp` must be 1). Gradients
are summed over ranks in one flat all-reduce (streamrl/losses.py defines losses so that the sum is
the step's gradient); ranks without micro-batches contribute zeros, so every rank applies the
same update and stays identical. Rank 0 is the weight source.

Checkpoints (`save`/`load`): `torch.save` of model, optimizer, scheduler and step by rank 0
(written to a temporary name, then renamed), plus `rng-<rank>.pt` per rank (torch CPU and CUDA and
Python `random` state). Loading restores them bit for bit, so a resumed step is identical to an
uninterrupted one.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from streamrl.config import JobSpec
from streamrl.errors import ConfigError
from streamrl.log import get_logger
from streamrl.weight_buckets import flatten_parameters
from workers.backends.base import LossFn, MicroBatch, copy_model_folder_files, step_metrics

log = get_logger(__name__)

CHECKPOINT = "hf_learner.pt"


class HFBackend:
    """One learner rank: model, optimizer, scheduler (see the module docstring)."""

    def __init__(
        self,
        spec: JobSpec,
        model_dir: str | Path,
        *,
        device: str | torch.device | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        lc = spec.learner
        if lc.tp != 1 or lc.pp != 1:
            raise ConfigError(
                f"learner.backend=hf supports data parallelism only, got learner.tp={lc.tp} and "
                f"learner.pp={lc.pp}: set both to 1 or use learner.backend=megatron"
            )
        if dist.is_available() and dist.is_initialized():
            self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        else:
            self.dp_rank, self.dp_size = 0, 1
        if self.dp_size != lc.dp:
            raise ConfigError(
                f"learner.dp={lc.dp} but torch.distributed has world size {self.dp_size}; "
                "the hf backend makes every rank a data-parallel rank"
            )
        self.is_source = self.dp_rank == 0
        if lc.threads is not None:
            torch.set_num_threads(lc.threads)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if compute_dtype is None and self.device.type == "cuda":
            compute_dtype = getattr(torch, spec.model.dtype)
        self.compute_dtype = None if compute_dtype == torch.float32 else compute_dtype
        self.model_dir = Path(model_dir)
        self.grad_clip = lc.grad_clip
        torch.manual_seed(spec.train.seed)
        with _no_progress_bar():
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model = model.to(self.device)
        # One aligned flat buffer per dtype: weight pushes send buckets as views (no packing copy),
        # and the engines, which store theirs the same way, compute bit-identical logits.
        flatten_parameters(dict(self.model.named_parameters()))
        self.model.eval()  # no dropout; see the module docstring
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        decay = [p for n, p in named if p.ndim > 1 and not n.endswith(".bias")]
        no_decay = [p for n, p in named if not (p.ndim > 1 and not n.endswith(".bias"))]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": lc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=lc.lr,
            betas=(lc.adam_beta1, lc.adam_beta2),
            eps=lc.adam_eps,
        )
        warmup = lc.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: min(1.0, (k + 1) / warmup) if warmup > 0 else 1.0
        )
        self.step = 0
        n_params = sum(p.numel() for p in self.params)
        log.info(
            "hf_backend_ready",
            model=str(self.model_dir),
            params=n_params,
            device=str(self.device),
            dp_rank=self.dp_rank,
            dp_size=self.dp_size,
            compute_dtype=str(self.compute_dtype or torch.float32),
        )

    # ------------------------------------------------------------ forward

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.compute_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def forward(self, mb: MicroBatch, *, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [b, T] (with grad if grad is enabled) and entropy [b, T] (with grad only if
        `entropy_grad`) of `mb.input_ids` on this backend's device; column 0 and padding are 0."""
        ids = mb.input_ids.to(self.device)
        real = mb.attention_mask.to(self.device)
        with self._autocast():
            logits = self.model(input_ids=ids, use_cache=False).logits  # [b, T, V]
        logp = logits[:, :-1].float().log_softmax(dim=-1)  # [b, T-1, V]: position t predicts t+1
        lp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # [b, T-1]
        with contextlib.nullcontext() if entropy_grad else torch.no_grad():
            src = logp if entropy_grad else logp.detach()
            ent = -(src.exp() * src).sum(dim=-1)  # [b, T-1]
        zero = torch.zeros_like(lp[:, :1])
        lp = torch.cat([zero, lp], dim=1).masked_fill(~real, 0.0)
        ent = torch.cat([zero.detach(), ent], dim=1).masked_fill(~real, 0.0)
        return lp, ent

    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """[b, T] float32 log-probs of `mb.input_ids` under the current weights (CPU, no grad)."""
        with torch.no_grad():
            lp, _ = self.forward(mb)
        return lp.cpu()

    # ------------------------------------------------------------ training

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        t0 = time.perf_counter()
        entropy_grad = bool(getattr(loss_fn, "needs_entropy_grad", False))
        self.optimizer.zero_grad(set_to_none=True)
        per_mb: list[dict[str, float]] = []
        tokens = 0
        for mb in micro_batches:
            mb_dev = _to_device(mb, self.device)
            lp, ent = self.forward(mb_dev, entropy_grad=entropy_grad)
            loss, metrics = loss_fn(mb_dev, lp, ent)
            loss.backward()
            per_mb.append(metrics)
            tokens += mb.num_tokens
        if self.dp_size > 1:
            self._all_reduce_grads()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip))
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning("update_skipped", step=self.step, grad_norm=grad_norm)
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        seconds = time.perf_counter() - t0
        return step_metrics(
            per_mb, grad_norm=grad_norm, lr=lr, skipped=skipped, tokens=tokens, seconds=seconds
        )

    def _all_reduce_grads(self) -> None:
        """Sum gradients over DP ranks in one flat buffer (a rank without micro-batches sends zeros)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p)
            offset += n

    # ------------------------------------------------------------ weights out

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """State-dict order under Hugging Face names; a tied tensor once, under its first name
        (`model.embed_tokens.weight`, not `lm_head.weight`), as save_pretrained writes it and as
        SGLang loads it (it skips lm_head when embeddings are tied). Tensors are detached views of
        the live weights: copy them before the next train_step if they must be kept."""
        if not self.is_source:
            return
        seen: set[tuple[int, tuple[int, ...]]] = set()
        for name, t in self.model.state_dict().items():
            key = (t.data_ptr(), tuple(t.shape))
            if t.numel() and key in seen:
                continue
            seen.add(key)
            yield name, t.detach()

    def export_hf(self, directory: Path) -> None:
        """save_pretrained (safetensors, float32) plus the tokenizer files of the model folder."""
        directory = Path(directory)
        if self.is_source:
            directory.mkdir(parents=True, exist_ok=True)
            with _no_progress_bar():
                self.model.save_pretrained(directory)
            copy_model_folder_files(self.model_dir, directory)
        self._barrier()

    # ------------------------------------------------------------ checkpoints

    def save(self, directory: Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if self.is_source:
            state = {
                "format": 1,
                "step": self.step,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            _atomic_save(state, directory / CHECKPOINT)
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        _atomic_save(rng, directory / f"rng-{self.dp_rank}.pt")
        self._barrier()
        log.info("learner_saved", path=str(directory), step=self.step)

    def load(self, directory: Path) -> None:
        directory = Path(directory)
        path = directory / CHECKPOINT
        if not path.exists():
            raise FileNotFoundError(f"no hf learner checkpoint at {path}")
        state = torch.load(path, map_location=self.device, weights_only=True)
        if state.get("format") != 1:
            raise ValueError(f"{path}: unknown checkpoint format {state.get('format')!r}")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        rng_path = directory / f"rng-{self.dp_rank}.pt"
        if rng_path.exists():
            rng = torch.load(rng_path, weights_only=True)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        else:  # resumed with more DP ranks: the state is replicated, only this rank's RNG is new
            log.warning("rng_state_missing", path=str(rng_path))
        log.info("learner_loaded", path=str(directory), step=self.step)

    def _barrier(self) -> None:
        if self.dp_size > 1:
            dist.barrier()


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """Silence transformers' per-tensor progress bars (noise in role logs and test output)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return mb
    return MicroBatch(
        input_ids=mb.input_ids.to(device),
        attention_mask=mb.attention_mask.to(device),
        loss_mask=mb.loss_mask.to(device),
        old_logprobs=mb.old_logprobs.to(device),
        advantages=mb.advantages.to(device),
        versions=mb.versions.to(device),
        prox_logprobs=None if mb.prox_logprobs is None else mb.prox_logprobs.to(device),
    )


def _atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def make_backend(spec: JobSpec, model_dir: str | Path, **kwargs: Any) -> HFBackend:
    """The hf backend for this rank (`device`, `compute_dtype` may override the defaults)."""
    return HFBackend(spec, model_dir, **kwargs)
