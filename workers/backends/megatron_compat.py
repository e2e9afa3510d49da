"""Every patch megatron-core needs to train on a CPU-only torch build; nothing else patches megatron.

megatron-core assumes CUDA: it seeds and forks CUDA RNG states, allocates buffers on
`torch.cuda.current_device()`, builds a few scalars with `device='cuda'` and asserts that gradients
are `torch.cuda.FloatTensor`. On a machine without CUDA each of those raises. The patches below were
written against megatron-core 0.16.1 and torch 2.13 and checked there (platform.md, "megatron-core
0.16.1 on CPU"); on any other version `apply()` refuses rather than patching code it has not seen.
Nothing is patched when CUDA is available: the GPU path runs megatron unmodified.

What is NOT made to work: the distributed optimizer (its type checks on wrapped params are
CUDA-only), fused kernels, activation recomputation (its RNG save/restore is CUDA-only); the
backend uses the non-distributed optimizer and no recomputation on CPU.

Usage: `apply()` once per process before building megatron objects (idempotent), and
`with cuda_to_cpu():` around megatron calls that construct scalars with `device='cuda'`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

MEGATRON_VERSION = "0.16.1"
TORCH_MAJOR_MINOR = "2.13"

_applied = False


class MegatronVersionError(RuntimeError):
    """The installed megatron-core or torch is not the version this compatibility layer was written for."""


def needed() -> bool:
    """True when the patches are needed (no usable CUDA device)."""
    return not torch.cuda.is_available()


def check_versions() -> None:
    """Raise `MegatronVersionError` naming both versions unless megatron-core and torch match."""
    try:
        megatron = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        megatron = "not installed"
    torch_mm = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if megatron != MEGATRON_VERSION or torch_mm != TORCH_MAJOR_MINOR:
        raise MegatronVersionError(
            f"workers/backends/megatron_compat.py was written for megatron-core {MEGATRON_VERSION} "
            f"with torch {TORCH_MAJOR_MINOR}.x, found megatron-core {megatron} with torch "
            f"{torch.__version__}: re-check each patch against the new version (the CPU learner "
            f"cannot run without them), then update the pins here"
        )


def import_megatron() -> None:
    """Import megatron.core quietly: without Transformer Engine or Apex it warns (UserWarning) at import
    that it falls back to torch implementations, which is exactly what we want on CPU; pytest's
    filterwarnings=error would otherwise turn those into errors."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        import megatron.core  # noqa: F401
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.optimizer_param_scheduler  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401


def apply() -> bool:
    """Install the CPU patches once; returns True if they are (now or already) installed, False when
    CUDA is available and nothing needs patching. Raises `MegatronVersionError` on other versions."""
    global _applied
    if not needed():
        return False
    if _applied:
        return True
    check_versions()
    import_megatron()
    _patch_current_device()
    _patch_rng_tracker()
    _patch_clip_grads()
    _silence_cuda_tuning_hint()
    _applied = True
    return True


def _require(module: Any, name: str) -> None:
    """A patch's target must exist: if megatron moved it, fail here rather than patch nothing."""
    if not hasattr(module, name):
        raise MegatronVersionError(f"megatron_compat: {module.__name__}.{name} is gone; re-check the patches")


# ---------------------------------------------------------------- torch.cuda entry points


def _patch_current_device() -> None:
    """~25 allocation sites (RoPE frequencies, TP gather/scatter buffers, DDP grad buffers) pass
    `device=torch.cuda.current_device()`, which asserts on a CPU build. Returning the CPU device
    keeps those allocations on the CPU. `torch.cuda.synchronize` (DDP buffer free/alloc paths) has
    nothing to wait for on the CPU. On a CPU-only build both functions could only raise before, so
    no working caller elsewhere in the process changes behaviour."""

    def current_device() -> torch.device:
        return torch.device("cpu")

    def synchronize(device: Any = None) -> None:
        return None

    torch.cuda.current_device = current_device  # type: ignore[assignment]
    torch.cuda.synchronize = synchronize  # type: ignore[assignment]


# ---------------------------------------------------------------- RNG tracker


def _patch_rng_tracker() -> None:
    """`model_parallel_cuda_manual_seed` and every attention forward (`get_cuda_rng_tracker().fork()`
    around attention dropout) save and restore CUDA generator states. The replacement tracker keeps
    the same named streams (data-parallel, model-parallel, expert) as CPU generator states and forks
    the CPU default generator, so TP ranks still draw independent dropout masks and the tracker's
    states can be checkpointed. It is installed by replacing the class megatron instantiates."""
    from megatron.core.tensor_parallel import random as mrandom

    for name in ("CudaRNGStatesTracker", "initialize_rng_tracker", "_MODEL_PARALLEL_RNG_TRACKER_NAME"):
        _require(mrandom, name)

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def __init__(
            self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False
        ) -> None:
            super().__init__(use_cudagraphable_rng=False, is_inference_rng_tracker=is_inference_rng_tracker)

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    # model_parallel_cuda_manual_seed also calls torch.cuda.manual_seed, which a CPU build queues
    # lazily without error; the data-parallel stream on the CPU is torch's default generator.
    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker  # type: ignore[misc]
    mrandom.initialize_rng_tracker(force_reset=True)


# ---------------------------------------------------------------- gradient clipping


def _patch_clip_grads() -> None:
    """`clip_grad_by_total_norm_fp32` asserts `param.grad.type() == 'torch.cuda.FloatTensor'` and
    scales through a `device='cuda'` overflow buffer. The replacement does the same in-place scale on
    whatever device the gradients live. It is bound where the optimizer looks it up (imported by
    name into megatron.core.optimizer.optimizer) as well as in clip_grads itself."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as moptimizer

    _require(clip_grads, "clip_grad_by_total_norm_fp32")
    _require(moptimizer, "clip_grad_by_total_norm_fp32")

    def clip_grad_by_total_norm_fp32(
        parameters: list[torch.Tensor] | torch.Tensor,
        max_norm: float,
        total_norm: float,
        use_decoupled_grad: bool = False,
    ) -> None:
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        attr = "decoupled_grad" if use_decoupled_grad else "grad"
        grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
        for g in grads:
            if g.dtype not in (torch.float32, torch.bfloat16):
                raise TypeError(f"clip_grad_by_total_norm_fp32: gradient dtype {g.dtype}, expected fp32/bf16")
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        if clip_coeff < 1.0 and math.isfinite(clip_coeff):
            torch._foreach_mul_(grads, clip_coeff)

    clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
    moptimizer.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32


def _silence_cuda_tuning_hint() -> None:
    """With TP > 1 the first column-parallel forward warns (UserWarning) that CUDA_DEVICE_MAX_CONNECTIONS
    should be 1: CUDA stream advice, meaningless on the CPU, and an error under pytest's
    filterwarnings=error. Megatron's own once-only flag is set as if it had already warned."""
    from megatron.core.tensor_parallel import layers

    _require(layers.linear_with_grad_accumulation_and_async_allreduce, "warned")
    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True  # type: ignore[attr-defined]


# ---------------------------------------------------------------- device='cuda' arguments


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites `device='cuda'` (and `.cuda()`, `.to('cuda')`) to the CPU. Needed where megatron
    builds scalars on a literal 'cuda' device: the FP32 optimizer's loss scale, the chained
    optimizer's found-inf/scale tensors, `get_grad_norm_fp32`'s overflow and norm buffers."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("cpu"), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Scope in which `device='cuda'` means the CPU. A no-op when CUDA is available. Scoped, not
    process-wide, because a TorchFunctionMode costs a Python call on every torch op."""
    if not needed():
        yield
        return
    with _CudaToCpu():
        yield
