"""Weight sync: a full update from this (learner) process to two embedded-engine processes, against
one raw broadcast of the same bytes in the same group.

    python -m bench.weight_sync [--quick] [--buckets 64,256,512] [--repeats 5] [--layers 4]
                                [--learner flat,separate]

What: a random Qwen2-shaped model (streamrl.tiny.random_model_dir: hidden 1024, 16 heads, 2 KV
heads, MLP 4096, fp32; 4 layers, about 250 MB, or 1 layer with --quick) is served by two embedded
engines (one torch thread each). This process holds the learner's copy and pushes it with
`WeightPusher.push` for each bucket size: probe, pause, for each bucket post
/update_weights_from_distributed and broadcast, answers, continue. Two learner layouts:
- flat: the parameters live in one buffer (`weight_buckets.flatten_parameters`, as the engines keep
  theirs), so every bucket goes as one flattened broadcast of a view of it, with no copy;
- separate: each parameter is its own tensor (a plain PyTorch model); on gloo the pusher then sends
  each tensor as its own broadcast (SGLang's per-tensor format), which costs less than packing the
  bucket (a copy at about 8 GB/s here).
The engines receive straight into their parameters either way.

- value: model bytes / wall time of `push()` (everything: probe, pause, gather and pack, wire, load,
  resume);
- limit: model bytes / time of ONE `dist.broadcast` of all those bytes as a single uint8 tensor from
  this process to both engines, in the same process group, posted the same way
  (`WeightPusher.raw_broadcast`: the engines receive it into a warm buffer and load nothing).

Each run is raw, push, raw (the limit of the run is the mean of its two raw broadcasts: the load of
a shared machine drifts), after one untimed warm-up of each (first-touch page faults); the table
shows the median and the range over `--repeats` runs, the ratio taken per run. Phases are the time
the pushing thread spent in each.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.common import emit, print_table

PHASES = ("connect", "pause", "gather", "wire", "load", "resume")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a 1-layer model (about 75 MB), fewer runs")
    p.add_argument("--buckets", default=None, help="bucket sizes in MB (default 64,256,512; quick 64,512)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed runs per bucket size (default 5; quick 3)"
    )
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; quick 1)")
    p.add_argument("--pause-mode", default="abort", choices=["abort", "in_place"])
    p.add_argument("--learner", default="flat,separate", help="learner weight layouts to measure")
    args = p.parse_args(argv)
    args.buckets = [int(b) for b in (args.buckets or ("64,512" if args.quick else "64,256,512")).split(",")]
    args.repeats = args.repeats or (3 if args.quick else 7)
    args.layers = args.layers or (1 if args.quick else 4)
    args.learner = args.learner.split(",")
    return args


def learner_weights(model_dir: Path, layout: str) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters: each in a fresh allocation of its own, or all in one flat buffer."""
    from transformers import AutoModelForCausalLM

    from streamrl.weight_buckets import flatten_parameters

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    if layout == "flat":
        flatten_parameters(params)
        return [(n, p.detach()) for n, p in params.items()]
    return [(n, p.detach().clone()) for n, p in params.items()]


def measure(
    urls: list[str], weights: list[tuple[str, torch.Tensor]], bucket_mb: int, args: argparse.Namespace
) -> dict[str, Any]:
    from streamrl.config import WeightSyncConfig
    from streamrl.weight_push import WeightPusher

    nbytes = sum(t.numel() * t.element_size() for _, t in weights)
    cfg = WeightSyncConfig(backend="gloo", bucket_mb=bucket_mb, pause_mode=args.pause_mode, timeout_s=300.0)
    runs: list[dict[str, float]] = []
    with WeightPusher(urls, cfg) as pusher:
        pusher.connect()
        pusher.raw_broadcast(nbytes)  # warm-up: both sides' buffers touched once
        pusher.push(weights, version=1)
        for i in range(args.repeats):
            before = pusher.raw_broadcast(nbytes)
            t = pusher.push(weights, version=2 + i)
            raw_s = (before + pusher.raw_broadcast(nbytes)) / 2
            assert t.bytes == nbytes and t.engines == 2, t
            runs.append(
                {
                    "raw_s": raw_s,
                    "total_s": t.total_s,
                    "calls": t.calls,
                    **{p: getattr(t, f"{p}_s") for p in PHASES},
                }
            )
        copied = pusher._packer.copied_bytes  # bench-only peek: bytes the sender had to copy
    ratios = [r["raw_s"] / r["total_s"] for r in runs]  # (bytes / total) / (bytes / raw)
    return {
        "bucket_mb": bucket_mb,
        "bytes": nbytes,
        "runs": runs,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "update_bps": [nbytes / r["total_s"] for r in runs],
        "raw_bps": [nbytes / r["raw_s"] for r in runs],
        "copied_fraction": copied / (nbytes * (args.repeats + 1)),
    }


def rng(values: list[float], scale: float) -> str:
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):,.0f} ({v[0]:,.0f}-{v[-1]:,.0f})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from streamrl.config import EmbeddedEngine
    from streamrl.log import configure
    from streamrl.tiny import random_model_dir
    from workers.engines.sglang import start_engines

    configure(role="bench", level="warning")
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        model_dir = random_model_dir(
            Path(tmp) / "model", hidden=1024, layers=args.layers, heads=16, kv_heads=2, intermediate=4096
        )
        engines = start_engines(
            EmbeddedEngine(count=2, threads=1), str(model_dir), log_dir=Path(tmp), health_timeout_s=300
        )
        try:
            for layout in args.learner:
                weights = learner_weights(model_dir, layout)
                nbytes = sum(t.numel() * t.element_size() for _, t in weights)
                for bucket_mb in args.buckets:
                    results.append({"learner": layout, **measure(engines.urls, weights, bucket_mb, args)})
                del weights
        finally:
            engines.stop()
    print(f"model: Qwen2-shaped, {args.layers} layers, {nbytes / 1e6:.0f} MB fp32")

    mb = 1e-6
    rows = []
    for r in results:
        runs = r["runs"]
        rows.append(
            [
                r["learner"],
                r["bucket_mb"],
                runs[0]["calls"],
                rng(r["update_bps"], mb),
                rng(r["raw_bps"], mb),
                f"{r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f})",
                *(statistics.median(x[p] for x in runs) * 1e3 for p in PHASES),
                statistics.median(x["total_s"] for x in runs) * 1e3,
                f"{r['copied_fraction']:.0%}",
            ]
        )
    headers = [
        "learner",
        "bucket MB",
        "calls",
        "update MB/s",
        "raw MB/s",
        "ratio",
        *(f"{p} ms" for p in PHASES),
    ]
    headers += ["total ms", "copied"]
    print_table(
        headers, rows, f"Full update to 2 engines ({nbytes / 1e6:.0f} MB), median (range) of {args.repeats}"
    )
    # the value: the job default bucket size (512 MB), the first layout asked for (flat by default)
    default = next((r for r in results if r["bucket_mb"] == 512), results[0])
    emit(
        "weight_sync",
        "update_bytes_per_s",
        statistics.median(default["update_bps"]),
        "raw_broadcast_bytes_per_s",
        statistics.median(default["raw_bps"]),
        {**vars(args), "model_bytes": nbytes, "value": f"{default['learner']}, {default['bucket_mb']} MB"},
        ratio_range=[default["ratio_min"], default["ratio_max"]],
        runs={
            f"{r['learner']}/{r['bucket_mb']}": {
                "ratio_median": r["ratio_median"],
                "ratio_range": [r["ratio_min"], r["ratio_max"]],
                "phases_ms": {p: statistics.median(x[p] for x in r["runs"]) * 1e3 for p in PHASES},
            }
            for r in results
        },
    )


if __name__ == "__main__":
    main()
