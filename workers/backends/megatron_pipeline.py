"""Pipeline parallelism for the megatron backend: megatron's 1F1B schedule, last-stage results shared
with the whole pipeline, and the stages' weights streamed to global rank 0.

Each pipeline stage is a GPTModel with its slice of the layers (`pre_process` on the first stage:
the embedding; `post_process` on the last: the final norm and output layer). Activations move
between stages by megatron's own p2p code (`megatron.core.pipeline_parallel`), which works on gloo:
`batch_isend_irecv` falls back to plain isend/irecv when the backend cannot coalesce, and the CUDA
calls around it are handled by `megatron_compat` (`current_device`, `synchronize`, and
`cuda_to_cpu()` for the schedule's `device='cuda'` token counter).

Micro-batches of one step may differ in shape: the schedule runs with `variable_seq_lengths`, so
every activation send is preceded by its [T, b, hidden] shape (three int64s) and no padding is
needed. Only the last stage has log-probs, losses and metrics; `from_last_stage_*` share them so
that every rank returns the same values from `train_step` and `logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from workers.backends import megatron_compat as compat
from workers.backends import megatron_convert as convert
from workers.backends.base import MicroBatch

# forward_step(data_iterator, model) -> (output tensor, loss function or None): megatron's contract
ForwardStep = Callable[[Iterator[MicroBatch], Any], tuple[torch.Tensor, Any]]


def run_schedule(
    model: Any, micro_batches: list[MicroBatch], forward_step: ForwardStep, forward_only: bool
) -> list[Any]:
    """One call of megatron's pipeline schedule over `micro_batches` (the same list on every stage of
    a pipeline); returns what the last stage's loss functions reported ([] on other stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        return []
    shapes = [tuple(mb.input_ids.shape) for mb in micro_batches]
    with compat.cuda_to_cpu():
        return list(
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=model,
                num_microbatches=len(micro_batches),
                # ignored for the p2p buffers (variable_seq_lengths sends each shape), but required
                seq_length=max(t for _, t in shapes),
                micro_batch_size=max(b for b, _ in shapes),
                forward_only=forward_only,
            )
        )


def from_last_stage_tensor(t: torch.Tensor, group: Any, pp: int) -> torch.Tensor:
    """`t` as the last stage has it, on every stage (others pass a buffer of the same shape)."""
    t = t.contiguous()
    dist.broadcast(t, group=group, group_src=pp - 1)
    return t


def from_last_stage_objects(obj: Any, group: Any, pp: int, device: torch.device) -> Any:
    """A picklable object (the step's per-micro-batch metrics) from the last stage, on every stage."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=pp - 1, device=device)
    return box[0]


def stage_weights(
    own: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    local_shapes: list[tuple[str, torch.Size, torch.dtype]],
    *,
    tp: int,
    tp_rank: int,
    pp: int,
    pp_rank: int,
    first_layer: int,
    group: Any,
    device: torch.device,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(global megatron name, full tensor) of every stage in stage order, yielded on pipeline rank 0
    of TP rank 0; `own()` is this stage's TP-gathered tensors (yielding only on TP rank 0, the other
    TP ranks join its gathers), `local_shapes` the names, shard shapes and dtypes it yields, in order.

    Stage s > 0 tells pipeline rank 0 the names and full shapes first (one pickled list), then sends
    the tensors one by one, so rank 0 holds one received tensor at a time."""
    if tp_rank != 0:
        for _ in own():  # joins this stage's TP gathers; yields nothing here
            pass
        return
    if pp_rank != 0:
        meta = [
            (convert.global_layer_name(n, first_layer), convert.full_shape(n, shape, tp), dtype)
            for n, shape, dtype in local_shapes
        ]
        dist.send_object_list([meta], group=group, group_dst=0, device=device)
        for _, t in own():
            dist.send(t.contiguous(), group=group, group_dst=0)
        return
    for name, t in own():
        yield convert.global_layer_name(name, first_layer), t
    for stage in range(1, pp):
        box: list[Any] = [None]
        dist.recv_object_list(box, group=group, group_src=stage, device=device)
        for name, shape, dtype in box[0]:
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, group=group, group_src=stage)
            yield name, buf
