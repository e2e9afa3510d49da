"""The learner role: batches from the buffer in, trained weights out to every engine.

    python -m workers.learner --job JOB.yaml --buffer ADDR --engines URL[,URL] --model DIR \
        --run-dir RUN_DIR [--resume]

Multi-rank learners (Megatron TP x PP x DP) are started as N processes with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 talks to the buffer and the engines; it
broadcasts each batch to the other ranks, and every rank runs the backend's collectives.

One step k (steps count from 0; the engines serve version k while it is trained):

    batch k  <- buffer (BatchRequest; NoBatch means wait: that time is the learner's idle time)
    micro-batches for this DP rank -> [proximal log-probs] -> backend.train_step(loss)
    weights  -> engines as version k + 1 (pause, bucketed broadcast, continue)
    WeightsPublished(version k + 1, step k) -> buffer, which marks batch k trained
    metrics line; evaluation and checkpoint (learner state + buffer snapshot) when due

SIGTERM or SIGINT means "finish the current step, checkpoint, exit 0", so the launcher's Ctrl-C
leaves a resumable run. A dead engine (the launcher restarts it alone) costs a wait, not the run: a
push that no engine takes is retried until the restarted one takes the full weights, and an
evaluation that loses its engine is skipped. `--resume` continues after the run directory's latest checkpoint; the
freshly started engines get that checkpoint's weights before the first batch is requested.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from streamrl import checkpoint, log
from streamrl.config import JobSpec
from streamrl.config_load import load_job_or_exit
from streamrl.errors import StreamrlError, WeightSyncError
from streamrl.evaluate import Evaluator
from streamrl.messages import (
    Batch,
    BatchRequest,
    NoBatch,
    SnapshotDone,
    SnapshotRequest,
    WeightsPublished,
    decode,
    encode,
    unpack,
)
from streamrl.metrics import batch_stats
from streamrl.transport_client import Client
from workers.engines.client import EngineError

logger = log.get_logger("workers.learner")
BATCH_WAIT_S = 1800.0  # no batch for this long means the generators are gone: fail loudly
ENGINE_WAIT_S = 1800.0  # no engine takes the weights for this long: fail (SGLang may load for ~30 min)
ENGINE_RETRY_S = 1.0


class LearnerError(StreamrlError):
    """The learner cannot go on: no batches, no engine taking the weights, or a protocol mismatch."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> tuple[int, int]:
    """Join the learner's default process group (torchrun env, or a world of one)."""
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if not dist.is_initialized():
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            init_method = "env://"
        elif world == 1:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        else:
            raise LearnerError(f"WORLD_SIZE={world} needs MASTER_ADDR and MASTER_PORT in the environment")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(hours=1)
        )
    return dist.get_rank(), dist.get_world_size()


def make_backend(spec: JobSpec, model_dir: Path) -> Any:
    if spec.learner.backend == "hf":
        from workers.backends.hf import make_backend as make
    else:
        from workers.backends.megatron import make_backend as make
    return make(spec, model_dir)


class LearnerRole:
    """The step loop. Rank 0 owns `client` (buffer), `pusher` (engines) and evaluation; others get None."""

    def __init__(
        self,
        spec: JobSpec,
        backend: Any,
        run_dir: Path,
        *,
        client: Client | None,
        pusher: Any,
        evaluator: Any = None,
        metrics: Any = None,
    ) -> None:
        self.spec, self.backend, self.run_dir = spec, backend, run_dir
        self.client, self.pusher, self.evaluator, self.metrics = client, pusher, evaluator, metrics
        self.rank = dist.get_rank()
        self.stopping = False
        self.started = time.monotonic()

    # ------------------------------------------------------------------ rank 0 <-> buffer

    def _fetch(self, step: int) -> tuple[Batch | None, float]:
        """Rank 0: the batch for `step` (None when asked to stop while waiting) and the seconds waited."""
        assert self.client is not None
        t0 = time.monotonic()
        while not self.stopping:
            reply = self.client.request(BatchRequest(step=step), timeout_s=60.0)
            if isinstance(reply, Batch):
                return reply, time.monotonic() - t0
            if not isinstance(reply, NoBatch):
                raise LearnerError(f"buffer answered BatchRequest with {type(reply).__name__}")
            if time.monotonic() - t0 > BATCH_WAIT_S:
                raise LearnerError(f"no batch for step {step} after {BATCH_WAIT_S:.0f} s")
            time.sleep(reply.retry_after_s)
        return None, time.monotonic() - t0

    def _share(self, batch: Batch | None) -> Batch | None:
        """Rank 0's batch (or None: stop) on every rank."""
        if dist.get_world_size() == 1:
            return batch
        box: list[bytes | None] = [encode(batch) if batch is not None else None]
        dist.broadcast_object_list(box, src=0)
        if self.rank == 0:
            return batch
        data = box[0]
        return None if data is None else decode(data)  # type: ignore[return-value]

    def _publish(self, version: int, step: int) -> None:
        assert self.client is not None
        self.client.send(WeightsPublished(version=version, step=step))

    # ------------------------------------------------------------------ the pieces of a step

    def push_weights(self, version: int) -> dict[str, float]:
        """Every rank iterates the weights (TP/PP gathers are collectives); rank 0 sends them.

        An update fails when no engine answers (all of them died and are restarting) or one dies
        mid-update. It is then pushed again, every ENGINE_RETRY_S, until an engine takes it: a
        restarted engine answers once it has loaded the model, and gets the full weights at once.
        Failing here instead would restart the whole job from its last checkpoint for the loss of
        one engine, which the launcher restarts by itself. On a stop request the update is given
        up so that the step can still be checkpointed (a resumed run pushes the weights first).
        """
        deadline, attempt = time.monotonic() + ENGINE_WAIT_S, 0
        while True:
            attempt += 1
            error: WeightSyncError | None = None
            times: dict[str, float] = {}
            if self.pusher is None:
                for _ in self.backend.hf_weights():
                    pass
            else:
                try:
                    times = dict(self.pusher.push(self.backend.hf_weights(), version=version).metrics())
                except WeightSyncError as e:
                    error = e
            retry = error is not None and not self.stopping and time.monotonic() < deadline
            if not self._agree(retry):  # rank 0 decides, so every rank iterates the weights again
                if error is not None and not self.stopping:
                    raise LearnerError(f"no engine took version {version} for {ENGINE_WAIT_S:.0f} s: {error}")
                if error is not None:
                    logger.warning("weight_push_given_up_on_stop", version=version, error=str(error))
                return times
            if attempt & (attempt - 1) == 0:  # attempts 1, 2, 4, 8...: an SGLang restart takes minutes
                logger.warning("weight_push_failed", version=version, attempt=attempt, error=str(error))
            time.sleep(ENGINE_RETRY_S)

    def train(self, batch: Batch) -> dict[str, float]:
        from streamrl.losses import make_loss_fn
        from streamrl.microbatch import build_micro_batches, loss_token_count, micro_batch_count

        b, max_tokens = self.backend, self.spec.learner.micro_batch_tokens
        mbs = build_micro_batches(batch, max_tokens, dp_rank=b.dp_rank, dp_size=b.dp_size)
        if self.spec.algorithm.recompute_logprobs:
            for mb in mbs:
                mb.prox_logprobs = b.logprobs(mb)
        # Gradients sum over micro-batches and DP ranks, so each loss is pre-scaled: by the step's
        # token count (global-token-mean) or by the number of micro-batches (token-mean).
        loss_fn = make_loss_fn(
            self.spec.algorithm,
            float(loss_token_count(batch)),
            micro_batches=micro_batch_count(batch, max_tokens, b.dp_size),
        )
        t0 = time.monotonic()
        out = b.train_step(mbs, loss_fn)
        seconds = time.monotonic() - t0
        # The whole step's tokens (every DP rank's share), read from the batch: no collective needed.
        tokens = sum(
            unpack("prompt_tokens", g.prompt_tokens).size + t.num_tokens
            for g in batch.groups
            for t in g.trajectories
        )
        return {**out, "train_s": seconds, "tokens": tokens, "tokens_per_s": tokens / max(seconds, 1e-9)}

    def evaluate(self, step: int) -> None:
        if self.rank != 0 or self.evaluator is None:
            return
        try:
            result = self.evaluator()
        except EngineError as e:
            # An engine died mid-evaluation. The launcher restarts it; losing this point of the
            # accuracy curve beats restarting the whole job from its last checkpoint.
            logger.warning("eval_failed", step=step, error=str(e))
            return
        logger.info("eval", step=step, **result)
        self._record("eval", step, result)

    def save(self, step: int) -> None:
        d = checkpoint.step_dir(self.run_dir, step)
        t0 = time.monotonic()
        self.backend.save(d / checkpoint.LEARNER)
        if dist.get_world_size() > 1:
            dist.barrier()
        if self.rank == 0:
            assert self.client is not None
            path = str(d / checkpoint.BUFFER_SNAPSHOT)
            reply = self.client.request(SnapshotRequest(step=step, path=path), timeout_s=120.0)
            if not isinstance(reply, SnapshotDone):
                raise LearnerError(f"buffer answered SnapshotRequest with {type(reply).__name__}")
            checkpoint.mark_latest(self.run_dir, step)
        logger.info("checkpoint_written", step=step, path=str(d), seconds=round(time.monotonic() - t0, 2))

    def _record(self, role: str, step: int, values: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics(role, step, values)

    # ------------------------------------------------------------------ the loop

    def run(self, first_step: int) -> int:
        """Train steps `first_step` .. `train.steps - 1`; returns the number of the last step done."""
        spec, every = self.spec, self.spec.learner.checkpoint_every
        if first_step > 0:
            # Resumed: the engines restarted with the initial weights; give them the checkpoint's.
            self._sync(first_step, step=first_step - 1)
        elif spec.eval.greedy or spec.eval.sampled_n:
            self.evaluate(-1)
        last = first_step - 1
        for step in range(first_step, spec.train.steps):
            batch, waited = self._fetch(step) if self.rank == 0 else (None, 0.0)
            batch = self._share(batch)
            if batch is None:
                break  # asked to stop while waiting: `last` is the step to checkpoint
            log.bind(step=step, policy_version=step)
            t0 = time.monotonic()
            values: dict[str, Any] = {**batch_stats(batch), **self.train(batch)}
            values.update(self._sync(step + 1, step))
            step_s = time.monotonic() - t0
            values.update(policy_version=step + 1, idle_s=waited, idle_ratio=waited / (waited + step_s))
            self._record("learner", step, values)
            logger.info(
                "step",
                reward=round(values["reward_mean"], 3),
                loss=round(values.get("loss", float("nan")), 4),
                tokens_per_s=round(values["tokens_per_s"]),
                idle_s=round(waited, 2),
            )
            last = step
            if spec.eval.every_steps and (step + 1) % spec.eval.every_steps == 0:
                self.evaluate(step)
            stop = self._agree_stop()
            if stop or step == spec.train.steps - 1 or (every and (step + 1) % every == 0):
                self.save(step)
            if stop:
                logger.info("stopping_on_signal", step=step)
                return last
        if last == spec.train.steps - 1:
            if not (spec.eval.every_steps and spec.train.steps % spec.eval.every_steps == 0):
                self.evaluate(last)
        elif last >= first_step:
            self.save(last)
        return last

    def _sync(self, version: int, step: int) -> dict[str, float]:
        times = self.push_weights(version)
        if self.rank == 0:
            self._publish(version, step)
        return times

    def _agree_stop(self) -> bool:
        """Stop if rank 0 was signalled (it decides for everyone, so all ranks save the same step)."""
        return self._agree(self.stopping)

    def _agree(self, decision: bool) -> bool:
        """Rank 0's `decision`, on every rank."""
        if dist.get_world_size() == 1:
            return decision
        flag = torch.tensor([1 if decision and self.rank == 0 else 0])
        dist.broadcast(flag, src=0)
        return bool(flag.item())


# ---------------------------------------------------------------- wiring


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="workers.learner", description="the learner role")
    ap.add_argument("--job", required=True, help="job spec YAML")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--buffer", required=True, help="the buffer's address")
    ap.add_argument("--engines", required=True, help="comma-separated engine URLs")
    ap.add_argument("--model", required=True, type=Path, help="initial Hugging Face model folder")
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--resume", action="store_true", help="continue after the run dir's latest checkpoint")
    ap.add_argument("--log-file")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    spec = load_job_or_exit(args.job, args.overrides)
    if spec.learner.threads:
        torch.set_num_threads(spec.learner.threads)
    rank, world = init_distributed()
    log.configure("learner", level=spec.logging.level, json_file=args.log_file, rank=rank)
    first_step = checkpoint.require_latest(args.run_dir) + 1 if args.resume else 0
    backend = make_backend(spec, args.model)
    if args.resume:
        backend.load(checkpoint.step_dir(args.run_dir, first_step - 1) / checkpoint.LEARNER)
    client = pusher = evaluator = writer = None
    role: LearnerRole | None = None
    try:
        if rank == 0:
            from streamrl.metrics import MetricsWriter
            from streamrl.weight_push import WeightPusher

            urls = args.engines.split(",")
            client = Client(args.buffer, role="learner", name="learner")
            client.connect(timeout_s=120.0)
            pusher = WeightPusher(urls, spec.weight_sync)
            pusher.connect()
            if spec.data.eval is not None:
                evaluator = Evaluator(spec, urls, args.model)
            writer = MetricsWriter(args.run_dir, "learner")
        role = LearnerRole(
            spec,
            backend,
            args.run_dir,
            client=client,
            pusher=pusher,
            evaluator=evaluator,
            metrics=None if writer is None else (lambda r, s, v: writer.write(v, step=s, role=r)),
        )

        def on_signal(signum: int, _frame: object) -> None:
            assert role is not None
            role.stopping = True
            logger.info("signal_received", signal=signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        logger.info("learner_started", world=world, first_step=first_step, steps=spec.train.steps)
        last = role.run(first_step)
        logger.info("learner_done", last_step=last, wall_s=round(time.monotonic() - role.started, 1))
        return 0
    except StreamrlError as e:
        logger.error("learner_failed", error=str(e))
        return 1
    finally:
        for resource in (evaluator, pusher, client):
            if resource is not None:
                resource.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
