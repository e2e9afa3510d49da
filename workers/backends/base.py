"""What a learner backend is: the contract between `workers/learner.py` and `hf.py` / `megatron.py`.

The learner worker owns the loop (batches, losses, weight push, checkpoints); a backend owns the
model and optimizer. Every learner rank builds the same backend and calls the same methods in the
same order (collectives inside a backend rely on that). Tensors are on the CPU unless a backend
says otherwise; shapes are in the annotations.

Token alignment used everywhere: a micro-batch holds whole sequences `prompt + response`, padded on
the right to `T`. Per-token tensors are indexed by the *target* position: entry `[i, t]` belongs to
`input_ids[i, t]`, so `logprobs[i, t] = log p(input_ids[i, t] | input_ids[i, :t])` and column 0 is 0.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


@dataclass(slots=True)
class MicroBatch:
    """Padded sequences plus the per-token tensors the loss needs; built by `streamrl.microbatch`."""

    input_ids: torch.Tensor  # [b, T] int64, prompt then response, right-padded with 0
    attention_mask: torch.Tensor  # [b, T] bool, True on real tokens (prompt and response)
    loss_mask: torch.Tensor  # [b, T] float32, 1 on model-generated response tokens, else 0
    old_logprobs: torch.Tensor  # [b, T] float32, behaviour log-probs from the engine (0 off-mask)
    advantages: torch.Tensor  # [b, T] float32, the trajectory's advantage on its response tokens
    versions: torch.Tensor  # [b, T] int32, weight version per token (-1 off-mask)
    prox_logprobs: torch.Tensor | None = None  # [b, T] recomputed by the learner (decoupled PPO)

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    @property
    def num_loss_tokens(self) -> float:
        return float(self.loss_mask.sum())


class ForwardOut(Protocol):
    logprobs: torch.Tensor  # [b, T] float32, with grad when training
    entropy: torch.Tensor  # [b, T] float32, detached


# loss_fn(micro_batch, logprobs [b, T], entropy [b, T]) -> (scalar loss to backprop, metrics)
LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


class Backend(Protocol):
    """One learner rank's model and optimizer. Built by `make_backend(spec, model_dir)` of each module
    after `torch.distributed` is initialised (world size 1 is fine)."""

    dp_rank: int
    dp_size: int
    is_source: bool
    """True on the one rank that holds full weights after `hf_weights()` and sends them to engines."""

    def logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """[b, T] log-probs of `mb.input_ids` under the current weights, no grad (proximal policy)."""
        ...

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """Forward/backward every micro-batch of this DP rank (gradients accumulate; `loss_fn` already
        scales each loss so the sum is the step's loss), then clip, optimizer and LR-scheduler step.

        Returns the step's metrics averaged over micro-batches plus `grad_norm` and `lr`.
        """
        ...

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under Hugging Face names, in a fixed order. Every rank must iterate it (TP/PP
        gathers are collectives); only the source rank yields tensors, the others yield nothing."""
        ...

    def save(self, directory: Path) -> None:
        """Write model, optimizer, scheduler and RNG state (every rank writes its part)."""
        ...

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote; the next `train_step` continues exactly where it left off."""
        ...

    def export_hf(self, directory: Path) -> None:
        """Write a Hugging Face checkpoint (config, safetensors, tokenizer) transformers can load."""
        ...


def step_metrics(
    per_mb: list[dict[str, float]],
    *,
    grad_norm: float,
    lr: float,
    skipped: bool,
    tokens: int,
    seconds: float,
) -> dict[str, float]:
    """A train step's metrics from its micro-batches' (mean; max for `*_max`; sum for `loss_tokens`),
    plus the step-level values every backend reports the same way."""
    out: dict[str, float] = {}
    for key in {k for m in per_mb for k in m}:
        vals = [float(m[key]) for m in per_mb if key in m]
        if key.endswith("_max"):
            out[key] = max(vals)
        elif key == "loss_tokens":
            out[key] = sum(vals)
        else:
            out[key] = sum(vals) / len(vals)
    out.update(
        grad_norm=grad_norm,
        lr=lr,
        update_skipped=1.0 if skipped else 0.0,
        micro_batches=float(len(per_mb)),
        tokens=float(tokens),
        train_step_s=seconds,
    )
    return out


# What export_hf copies from the source model folder next to the weights it writes.
MODEL_FOLDER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def copy_model_folder_files(source: Path, directory: Path) -> None:
    """Tokenizer, chat template and generation config of `source` into an exported folder; a file the
    export already wrote (save_pretrained writes generation_config.json) is kept."""
    for name in MODEL_FOLDER_FILES:
        if (source / name).is_file() and not (directory / name).exists():
            shutil.copy2(source / name, directory / name)
