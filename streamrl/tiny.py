"""Tiny Qwen2 models for CPU: `streamrl tiny build --task arith|tool --out DIR`.

No weights can be downloaded where streamrl's CPU demos run, so streamrl makes its own small Qwen2
in Hugging Face format (config.json, model.safetensors, tokenizer.json) and warm-starts it with a
short seeded supervised phase (tiny_data.py: text and per-task settings; tiny_train.py: the loop).
The warm start stops inside a held-out accuracy band, so RL still has room to improve:

* arith (4 layers, 1.07M parameters): greedy accuracy in 20-40%. Seed 0 keeps step 350 after
  68 s on 2 lightly loaded cores: greedy 24%, sampled 14%. Seeds 1-4 reach the band in 200-480 steps.
* tool (2 layers, 0.58M parameters): *sampled* accuracy in 20-50%, because greedy decoding is right
  long before sampling is. Seed 0 stops at step 75 after 20 s: greedy 78% (tool calls 100%), sampled
  30% (tool calls 75%); seeds 1-3 take 24-35 s. That speed needs `copy_prior_init` (tiny_train.py).

The tokenizer pitfall (platform.md): with transformers 5, `AutoTokenizer` on a folder whose config
says qwen2 returns `Qwen2Tokenizer`, which rebuilds the normalizer (NFC), pre-tokenizer (Qwen2's
split regex, isolated, then byte-level without regex) and decoder (byte-level) itself and ignores
those in tokenizer.json. `make_tokenizer` therefore builds exactly that pipeline, so the file and
the class agree, and names `Qwen2Tokenizer` in tokenizer_config.json so a folder without config.json
loads the same way.

`ensure(task)` builds once per (task, seed, format) into `~/.cache/streamrl/tiny/<task>-<hash>`
(root overridable with STREAMRL_CACHE): under an fcntl lock, into a temporary folder, marker file
last, then one rename, so a reader never sees half a build.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from streamrl import templates
from streamrl.tiny_data import PLANS, TASKS, Task, tokenizer_corpus, train_stream

if TYPE_CHECKING:  # heavy imports stay inside the functions that need them
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
VOCAB_SIZE = 1024  # upper bound: BPE stops merging once every word of the corpus is one token
FORMAT_VERSION = 1  # bump when the model, data or training changes in a way the cache hash cannot see
MARKER = "streamrl_tiny.json"  # written last: its presence means the folder is complete


# ---------------------------------------------------------------- tokenizer and model folder


# A safety net, not the stopping rule: builds stop at fixed steps once held-out accuracy is in the
# band (68 s for arith, 20 s for tool on an idle 2-core machine). A tight budget made the result
# depend on machine load: with other work on the cores, a 150 s budget once cut arith off at 1%.
DEFAULT_BUDGET_S = 600.0


def make_tokenizer(
    corpus: Iterable[str], vocab_size: int, out_dir: Path | None = None
) -> PreTrainedTokenizerFast:
    """Byte-level BPE with exactly Qwen2's normalizer, pre-tokenizer and decoder, trained on `corpus`.

    Returns a `transformers.PreTrainedTokenizerFast` (eos `<|im_end|>`, pad `<|endoftext|>`), saved
    to `out_dir` when given.
    """
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(templates.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown tokens
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=templates.IM_END, pad_token=templates.EOT)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        fast.save_pretrained(out_dir)
        cfg_path = out_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(tokenizer_class="Qwen2Tokenizer", unk_token=None, bos_token=None, add_prefix_space=False)
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return fast


def _model_config(
    vocab: int, eos: int, pad: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int
) -> Qwen2Config:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=2048,  # rStar2 prompt (~350 tokens) plus multi-turn responses
        tie_word_embeddings=True,  # the embedding is a big share of a 1M model
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )


def _new_model(out_dir: Path, seed: int, **shape: int) -> tuple[PreTrainedTokenizerFast, Qwen2ForCausalLM]:
    """Tokenizer in `out_dir` and a freshly initialised fp32 Qwen2ForCausalLM (not yet saved)."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tok = make_tokenizer(tokenizer_corpus(), VOCAB_SIZE, out_dir)
    eos, pad = tok.convert_tokens_to_ids(templates.IM_END), tok.pad_token_id
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_model_config(len(tok), eos, pad, **shape)).float()
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, do_sample=False)
    return tok, model


def random_model_dir(
    out_dir: Path,
    task: Literal["arith", "tool"] = "arith",
    seed: int = 0,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 512,
) -> Path:
    """Tokenizer + randomly initialised Qwen2ForCausalLM in HF format, in about a second (for tests).

    `task` is recorded only: the tokenizer covers both tasks' text.
    """
    out_dir = Path(out_dir)
    shape = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate)
    _, model = _new_model(out_dir, seed, **shape)
    _save(model, out_dir)
    (out_dir / "streamrl_random.json").write_text(json.dumps({"task": task, "seed": seed, **shape}) + "\n")
    return out_dir


# ---------------------------------------------------------------- warm start


@dataclass
class BuildReport:
    path: str
    task: str
    seed: int
    steps: int
    examples: int
    wall_s: float
    train_loss: float  # mean over the last 20 training steps
    heldout_accuracy: float  # greedy, exact final \boxed{} answer
    tool_call_rate: float | None = None  # tool task: greedy first turns with a well-formed call
    tool_success_rate: float | None = None  # ... whose code ran
    sampled_accuracy: float | None = None  # at temperature 1 (seeded), as RL rollouts sample
    sampled_tool_call_rate: float | None = None
    criterion: str = "greedy"  # which accuracy the stopping band applied to
    stopped: str = ""  # "band", "rollback" (an earlier snapshot was in the band) or "budget"
    history: list[dict[str, float]] = field(default_factory=list)  # one row per held-out check

    @classmethod
    def load(cls, path: Path) -> BuildReport:
        return cls(**json.loads((path / MARKER).read_text()))


def build(
    task: Task,
    out_dir: Path,
    *,
    seed: int = 0,
    time_budget_s: float = DEFAULT_BUDGET_S,
    progress: bool = True,
) -> BuildReport:
    """Tokenizer + model + seeded SFT warm start in `out_dir`; the marker file is written last.

    Stops once held-out accuracy (the task plan's criterion) is inside its band, rolling back a
    few steps if a check overshoots it, or when `time_budget_s` (the whole build, checks included)
    runs out. Data order, initialisation and check points depend only on `seed`; only a budget stop
    depends on the machine's speed.
    """
    import torch

    if task not in TASKS:
        raise ValueError(f"unknown tiny task {task!r}; expected one of {TASKS}")
    start = time.monotonic()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the CPU demo machine has 2 cores; more threads only contend
    try:
        return _build(task, Path(out_dir), seed, time_budget_s, progress, start)
    finally:
        torch.set_num_threads(threads)  # ensure() may run inside a process with its own setting


def _build(
    task: Task, out_dir: Path, seed: int, time_budget_s: float, progress: bool, start: float
) -> BuildReport:
    import torch

    from streamrl.tiny_train import copy_prior_init, warm_start

    (out_dir / MARKER).unlink(missing_ok=True)  # a rebuild in place is incomplete until it ends
    plan = PLANS[task]
    tok, model = _new_model(
        out_dir, seed, hidden=128, layers=plan.layers, heads=4, kv_heads=2, intermediate=512
    )
    if plan.copy_prior:
        torch.manual_seed(seed)
        copy_prior_init(model, plan.copy_prior)
    with _Progress(task, time_budget_s, progress, start) as bar:
        done = warm_start(model, tok, task, plan, seed, start + time_budget_s, bar.update)
    _save(model, out_dir)
    report = BuildReport(
        path=str(out_dir),
        task=task,
        seed=seed,
        steps=done.steps,
        examples=done.steps * plan.batch,
        wall_s=round(time.monotonic() - start, 1),
        train_loss=round(done.train_loss, 4),
        heldout_accuracy=done.greedy.accuracy,
        tool_call_rate=done.greedy.tool_call_rate,
        tool_success_rate=done.greedy.tool_success_rate,
        sampled_accuracy=done.sampled.accuracy,
        sampled_tool_call_rate=done.sampled.tool_call_rate,
        criterion=plan.criterion,
        stopped=done.stopped,
        history=done.history,
    )
    (out_dir / MARKER).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def _save(model: Qwen2ForCausalLM, out_dir: Path) -> None:
    """save_pretrained without its per-shard progress bar (noise in logs and test output)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out_dir)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


class _Progress:
    """A rich progress line (bar over the time budget, step, loss, last held-out accuracy), or nothing."""

    def __init__(self, task: str, budget_s: float, enabled: bool, start: float) -> None:
        self.enabled, self.task, self.budget_s, self.start = enabled, task, budget_s, start

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn(f"tiny {self.task}"), BarColumn(), TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(), console=Console(stderr=True),
            )  # fmt: skip
            self.bar.__enter__()
            self.id = self.bar.add_task("warm start", total=self.budget_s, info="")
        return self

    def update(self, step: int, loss: float, history: list[dict[str, float]]) -> None:
        if self.enabled:
            info = f"step {step} loss {loss:.3f}"
            for key, value in (history[-1] if history else {}).items():
                if key.endswith(("_accuracy", "_tool_call_rate")):  # e.g. "sampled_accuracy 31%"
                    info += f" {key.replace('_', ' ')} {value:.0%}"
            elapsed = time.monotonic() - self.start
            self.bar.update(self.id, completed=min(elapsed, self.budget_s), info=info)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.bar.__exit__(None, None, None)


# ---------------------------------------------------------------- cache


def cache_root() -> Path:
    return Path(os.environ.get("STREAMRL_CACHE") or Path.home() / ".cache" / "streamrl").expanduser() / "tiny"


def version_hash(task: Task, seed: int, time_budget_s: float) -> str:
    """Changes whenever the rendered training text or the build settings change.

    The budget is part of it: a 3-second test build must never be mistaken for the real one.
    """
    first = next(train_stream(task, seed, set()))
    key = json.dumps([FORMAT_VERSION, task, seed, time_budget_s, first.text, asdict(PLANS[task]), VOCAB_SIZE])
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def ensure(
    task: Task,
    cache_dir: Path | None = None,
    seed: int = 0,
    *,
    time_budget_s: float = DEFAULT_BUDGET_S,
    progress: bool = True,
) -> Path:
    """The cached warm-started model folder for `task`, built on first use.

    `cache_dir` replaces `~/.cache/streamrl/tiny`. Safe when several processes call it at once: one
    builds under an exclusive lock, the others wait and reuse its result.
    """
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    name = f"{task}-{version_hash(task, seed, time_budget_s)}"
    final = root / name
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (final / MARKER).is_file():
            return final  # another process built it while we waited
        # Leftovers of builds that died (we hold the lock, so nobody is writing them now).
        for stale in root.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():
            shutil.rmtree(final)  # no marker: half-written, never reuse
        tmp = root / f".{name}.tmp-{os.getpid()}"
        build(task, tmp, seed=seed, time_budget_s=time_budget_s, progress=progress)
        report = BuildReport.load(tmp)
        report.path = str(final)
        if report.stopped == "budget":
            print(
                f"warning: the tiny {task} model hit its {time_budget_s:.0f} s budget before reaching its "
                f"accuracy band (held-out {report.heldout_accuracy}); RL may have little to start from",
                file=sys.stderr,
            )
        (tmp / MARKER).write_text(json.dumps(asdict(report), indent=2) + "\n")
        os.rename(tmp, final)
    return final


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="streamrl tiny", description="Tiny warm-started Qwen2 models for CPU."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build a warm-started model into --out")
    b.add_argument("--out", type=Path, required=True)
    e = sub.add_parser("ensure", help="print the cached model folder, building it on first use")
    for p in (b, e):
        p.add_argument("--task", choices=TASKS, required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--time-budget-s", type=float, default=DEFAULT_BUDGET_S)
        p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "ensure":
        print(ensure(args.task, seed=args.seed, time_budget_s=args.time_budget_s, progress=not args.quiet))
        return 0
    report = build(
        args.task, args.out, seed=args.seed, time_budget_s=args.time_budget_s, progress=not args.quiet
    )
    print(json.dumps({k: v for k, v in asdict(report).items() if k != "history"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
