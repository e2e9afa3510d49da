"""The hf learner backend on a tiny random Qwen2: log-probs equal a real embedded engine's, training
moves log-probs the way advantages say, resume is bit-exact, export and weight names load back, and
two data-parallel processes train exactly like one."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl import messages as m
from streamrl.config import AlgorithmConfig, EmbeddedEngine
from streamrl.errors import ConfigError
from streamrl.losses import make_loss_fn
from streamrl.microbatch import build_micro_batches, micro_batch_count
from streamrl.tiny import random_model_dir
from tests.conftest import free_port
from tests.workers.backends._hf_dp_worker import (
    DP_SEQUENCES,
    MAX_TOKENS,
    STEPS,
    dp_train,
    job_spec,
    make_batch,
)
from workers.backends.hf import HFBackend, make_backend
from workers.engines.client import EngineClient, SamplingParams
from workers.engines.sglang import start_engines

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_model_dir(tmp_path_factory.mktemp("model"), seed=0)


@pytest.fixture(scope="module")
def engine_url(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    engines = start_engines(
        EmbeddedEngine(threads=1, max_batch=16),
        str(model_dir),
        log_dir=tmp_path_factory.mktemp("engine-logs"),
        health_timeout_s=90.0,
    )
    try:
        yield engines.urls[0]
    finally:
        engines.stop()


def backend(model_dir: Path, **algorithm: object) -> HFBackend:
    return make_backend(job_spec(model_dir, **algorithm), model_dir)


def sequence_logprob(b: HFBackend, batch: m.Batch) -> list[float]:
    """Summed response log-prob of each (single-trajectory) group, in group order."""
    (mb,) = build_micro_batches(batch, 10_000)
    lp = (b.logprobs(mb) * mb.loss_mask).sum(dim=1)
    first_token = mb.input_ids[:, 0].tolist()
    return [lp[first_token.index(m.unpack("prompt_tokens", g.prompt_tokens)[0])].item() for g in batch.groups]


def test_logprobs_match_the_embedded_engines_at_temperature_1(engine_url: str, model_dir: Path) -> None:
    prompts = [[5, 6, 7], list(range(10, 17)), list(range(30, 42)), list(range(50, 70))]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True)

    async def generate() -> list:
        async with EngineClient(engine_url, timeout_s=60.0) as client:  # concurrent: batched decode
            return list(await asyncio.gather(*(client.generate(p, params) for p in prompts)))

    outs = asyncio.run(generate())
    groups = []
    for k, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        n = len(out.output_ids)
        traj = m.Trajectory(
            sample_index=0,
            tokens=m.pack("tokens", out.output_ids),
            loss_mask=m.pack("loss_mask", [1] * n),
            logprobs=m.pack("logprobs", out.logprobs),
            versions=m.pack("versions", [out.weight_version] * n),
            reward=0.0,
            finish_reason=out.finish_reason,
        )
        groups.append(
            m.Group(
                uid=k,
                prompt_id=str(k),
                admitted_version=0,
                generator="t",
                prompt_tokens=m.pack("prompt_tokens", prompt),
                trajectories=[traj],
            )
        )
    batch = m.Batch(step=0, policy_version=0, groups=groups, advantages=[m.pack("advantages", [0.0])] * 4)
    b = backend(model_dir)
    mbs = build_micro_batches(batch, max_tokens=64)  # 27-44 tokens each: several padded micro-batches
    assert len(mbs) > 1 and any(not bool(mb.attention_mask.all()) for mb in mbs)
    for mb in mbs:
        lp = b.logprobs(mb)
        on = mb.loss_mask > 0
        assert int(on.sum()) > 0
        assert (lp[on] - mb.old_logprobs[on]).abs().max().item() < 1e-4
        assert (lp[:, 0] == 0).all() and (lp[~mb.attention_mask] == 0).all()


def test_training_raises_the_logprob_of_positive_advantage_sequences_and_lowers_negative_ones(
    model_dir: Path,
) -> None:
    b = backend(model_dir)
    batch = make_batch([(4, 12, 1.0), (4, 12, -1.0)], seed=1)
    before = sequence_logprob(b, batch)
    mbs = build_micro_batches(batch, MAX_TOKENS)
    for mb in mbs:  # on-policy: the behaviour log-probs are the current ones
        mb.old_logprobs = b.logprobs(mb) * mb.loss_mask
    fn = make_loss_fn(AlgorithmConfig(), None, micro_batches=len(mbs))
    metrics = [b.train_step(mbs, fn) for _ in range(3)]
    after = sequence_logprob(b, batch)
    assert after[0] > before[0] + 0.1 and after[1] < before[1] - 0.1
    first = metrics[0]
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5) and first["clip_frac_low"] == 0.0
    assert first["lr"] == pytest.approx(1e-3 / 3) and metrics[1]["lr"] == pytest.approx(2e-3 / 3)
    assert first["grad_norm"] > 0 and first["entropy"] > 0 and first["tokens"] == 32
    assert first["update_skipped"] == 0.0 and b.step == 3


def test_resume_from_a_checkpoint_continues_bit_exactly(model_dir: Path, tmp_path: Path) -> None:
    batch1 = make_batch(DP_SEQUENCES, seed=2)
    batch2 = make_batch(DP_SEQUENCES, seed=3)
    fn = make_loss_fn(AlgorithmConfig(), None, micro_batches=micro_batch_count(batch1, MAX_TOKENS))
    mbs1, mbs2 = build_micro_batches(batch1, MAX_TOKENS), build_micro_batches(batch2, MAX_TOKENS)
    assert len(mbs1) > 1  # gradients accumulate over micro-batches

    a = backend(model_dir)
    a.train_step(mbs1, fn)
    a.save(tmp_path / "ckpt")
    expected_metrics = a.train_step(mbs2, fn)
    expected = a.model.state_dict()

    b = backend(model_dir)
    assert not torch.equal(b.model.state_dict()["model.norm.weight"], expected["model.norm.weight"])
    b.load(tmp_path / "ckpt")
    assert b.step == 1
    metrics = b.train_step(mbs2, fn)
    got = b.model.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert metrics["lr"] == expected_metrics["lr"] and metrics["grad_norm"] == expected_metrics["grad_norm"]
    for sa, sb in zip(a.optimizer.state.values(), b.optimizer.state.values(), strict=True):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_export_loads_with_transformers_and_gives_identical_logits(model_dir: Path, tmp_path: Path) -> None:
    b = backend(model_dir)
    batch = make_batch(DP_SEQUENCES[:2])
    b.train_step(build_micro_batches(batch, MAX_TOKENS), make_loss_fn(AlgorithmConfig(), None))
    out = tmp_path / "export"
    b.export_hf(out)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, b.model(ids).logits)
    text = "What is 12+30? \\boxed{42}"
    assert AutoTokenizer.from_pretrained(out).encode(text) == AutoTokenizer.from_pretrained(model_dir).encode(
        text
    )


def test_hf_weights_name_every_tensor_once_and_load_into_a_fresh_model(model_dir: Path) -> None:
    b = backend(model_dir)
    b.train_step(
        build_micro_batches(make_batch(DP_SEQUENCES[:2]), MAX_TOKENS), make_loss_fn(AlgorithmConfig(), None)
    )
    weights = list(b.hf_weights())
    names = [n for n, _ in weights]
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    keys = list(fresh.state_dict())
    assert len(set(names)) == len(names) and names == [k for k in keys if k in names]  # state-dict order
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: sent once
    assert {n for n, _ in fresh.named_parameters()} == set(names)
    params = fresh.state_dict(keep_vars=True)  # what the embedded engine's weight loader writes into
    with torch.no_grad():
        for n, t in weights:
            params[n].copy_(t)
        ids = torch.tensor([[7, 7, 1, 2, 3]])
        assert torch.equal(fresh(ids).logits, b.model(ids).logits)


def test_tensor_or_pipeline_parallel_and_wrong_dp_are_refused_clearly(model_dir: Path) -> None:
    spec = job_spec(model_dir)
    with pytest.raises(ConfigError, match="learner.tp=2"):
        make_backend(type(spec)(**{**_fields(spec), "learner": _learner(spec, tp=2)}), model_dir)
    with pytest.raises(ConfigError, match="learner.dp=2 but torch.distributed has world size 1"):
        make_backend(type(spec)(**{**_fields(spec), "learner": _learner(spec, dp=2)}), model_dir)


def _fields(spec: object) -> dict[str, object]:
    return {f: getattr(spec, f) for f in spec.__struct_fields__}  # type: ignore[attr-defined]


def _learner(spec: object, **changes: int) -> object:
    import msgspec

    return msgspec.structs.replace(spec.learner, **changes)  # type: ignore[attr-defined]


@pytest.mark.slow  # ~25 s on 2 busy cores, mostly two interpreters importing torch and transformers
def test_two_data_parallel_processes_train_like_one(model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    cmd = [sys.executable, "-m", "tests.workers.backends._hf_dp_worker", str(model_dir), str(tmp_path)]
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r)}, cwd=REPO_ROOT) for r in range(2)]
    try:
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    single = backend(model_dir, loss_agg="global-token-mean")
    dp_train(single, STEPS)
    rank0 = torch.load(tmp_path / "rank-0.pt", weights_only=True)
    rank1 = torch.load(tmp_path / "rank-1.pt", weights_only=True)
    for name, expected in single.model.state_dict().items():
        assert torch.equal(rank0[name], rank1[name]), name  # every rank applies the same update
        torch.testing.assert_close(rank0[name], expected, rtol=0, atol=2e-6)
