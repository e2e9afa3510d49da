"""Weights out of a megatron learner: full Hugging Face tensors, an exported HF folder, per-rank checkpoints.

`MegatronBackend.hf_weights`, `export_hf`, `save` and `load` delegate here. Sharded weights are
gathered over the TP group onto TP rank 0 and unsharded (`megatron_convert`); with pp > 1 each
later stage sends its tensors to the source rank (`megatron_pipeline.stage_weights`). Checkpoints
are one file per rank plus `megatron_layout.json`, so resuming needs the same tp/pp/dp (a different
layout: `export_hf`, then start from the exported model).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from workers.backends import megatron_compat as compat
from workers.backends import megatron_convert as convert
from workers.backends import megatron_pipeline as pipeline
from workers.backends.base import copy_model_folder_files
from workers.backends.megatron_build import MegatronBackendError

if TYPE_CHECKING:
    from workers.backends.megatron import MegatronBackend

# ------------------------------------------------------------------ weights out


def _gathered(b: MegatronBackend) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, full tensor) on TP rank 0 of DP replica 0; other ranks join the gathers."""
    for name, t in b.module.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        t = t.detach()
        if b.tp == 1:
            yield name, t
            continue
        if convert.tp_split_dim(name) is None:
            if b.tp_rank == 0:
                yield name, t
            continue
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(b.tp)] if b.tp_rank == 0 else None
        dist.gather(t, parts, group=b.tp_group, group_dst=0)
        if parts is not None:
            yield name, convert.unshard(name, parts)


def _shipped(b: MegatronBackend) -> Iterator[tuple[str, torch.Tensor]]:
    """`_gathered` less the last stage's copy of tied embeddings (the first stage's is sent)."""
    for name, t in _gathered(b):
        if not (name == "output_layer.weight" and b.shape.tie_word_embeddings):
            yield name, t


def hf_weights(b: MegatronBackend) -> Iterator[tuple[str, torch.Tensor]]:
    """Full weights under Hugging Face names (megatron state-dict order, q/k/v and gate/up split,
    stage after stage), yielded on the source rank only; every rank of DP replica 0 takes part
    (TP gathers, then each later stage sends its tensors to the source). Tensors may be views of
    the live parameters: copy them if they must outlive the next `train_step`."""
    if b.dp_rank != 0:
        return
    local_shapes = [
        (name, t.shape, t.dtype)
        for name, t in b.module.state_dict().items()
        if not name.endswith("_extra_state")
        and not (name == "output_layer.weight" and b.shape.tie_word_embeddings)
    ]
    stages = pipeline.stage_weights(
        lambda: _shipped(b),
        local_shapes,
        tp=b.tp,
        tp_rank=b.tp_rank,
        pp=b.pp,
        pp_rank=b.pp_rank,
        first_layer=b.first_layer,
        group=b.pp_group,
        device=b.device,
    )
    for name, full in stages:
        hf = convert.megatron_to_hf({name: full}, b.shape)
        if b.is_source:
            yield from hf.items()


def export_hf(b: MegatronBackend, directory: Path) -> None:
    """config.json, model.safetensors and the source model's tokenizer files, written by the source rank."""
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in hf_weights(b)}
    if b.is_source:
        directory.mkdir(parents=True, exist_ok=True)
        copy_model_folder_files(b.model_dir, directory)
        cfg = dict(b.hf_config)
        dtype = str(b.dtype).removeprefix("torch.")
        cfg["dtype"] = dtype
        if "torch_dtype" in cfg:
            cfg["torch_dtype"] = dtype
        (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    dist.barrier()


# ------------------------------------------------------------------ checkpoints


def _layout(b: MegatronBackend) -> dict[str, Any]:
    return {
        "tp": b.tp,
        "pp": b.pp,
        "dp": b.dp_size,
        "world": dist.get_world_size(),
        "dtype": str(b.dtype),
    }


def save(b: MegatronBackend, directory: Path) -> None:
    """Per-rank file: model shard, optimizer and scheduler state, RNG states, step count (same layout to load)."""
    from megatron.core import tensor_parallel

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {
        "model": {k: v for k, v in b.module.state_dict().items() if not k.endswith("_extra_state")},
        "optimizer": b.optimizer.state_dict(),
        "scheduler": b.scheduler.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "rng_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "steps_done": b.steps_done,
    }
    path = directory / f"megatron_rank{b.rank:05d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    if b.rank == 0:
        (directory / "megatron_layout.json").write_text(json.dumps(_layout(b)) + "\n")
    dist.barrier()


def load(b: MegatronBackend, directory: Path) -> None:
    """Restore what `save` wrote (same tp/pp/dp and dtype, checked against megatron_layout.json)."""
    from megatron.core import tensor_parallel

    directory = Path(directory)
    layout_file = directory / "megatron_layout.json"
    if not layout_file.is_file():
        raise MegatronBackendError(
            f"{directory}: not a megatron learner checkpoint (no megatron_layout.json)"
        )
    saved = json.loads(layout_file.read_text())
    if saved != _layout(b):
        raise MegatronBackendError(
            f"{directory}: written with layout {saved}, this run is {_layout(b)}; "
            f"resume with the same tp/pp/dp, or export_hf and start from the exported model"
        )
    state = torch.load(directory / f"megatron_rank{b.rank:05d}.pt", map_location=b.device, weights_only=True)
    with torch.no_grad():
        params = dict(b.module.named_parameters())
        for name, t in state["model"].items():
            params[name].copy_(t)
    with compat.cuda_to_cpu():
        b.optimizer.load_state_dict(state["optimizer"])
    b.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng_cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker"])
    b.steps_done = int(state["steps_done"])
    dist.barrier()
