"""Megatron-core learner backend on CPU: conversion, numerics against transformers, TP=2 == DP=2 ==
PP=2 == TP=1, checkpoint resume, Hugging Face export.

The TP=1 backend runs in this process (a gloo world of one, built once per module); TP=2, DP=2 and
PP=2 run in two real processes (`_megatron_worker`) that start while the TP=1 reference is computed
here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.conftest import free_port, stop_process
from tests.workers.backends._megatron_worker import (
    bonus_loss_fn,
    loss_fn,
    micro_batch,
    run_steps,
    step_batches,
    tiny_spec,
)
from workers.backends import megatron_compat
from workers.backends import megatron_convert as convert
from workers.backends.base import MicroBatch

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from streamrl.tiny import random_model_dir

    # 2 query groups, so TP=2 puts one group on each rank; vocab 672.
    return random_model_dir(
        tmp_path_factory.mktemp("tiny") / "m", hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128
    )


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    """torch.distributed with one gloo rank in this process, and megatron's parallel state on it."""
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.fail("a process group with more than one rank is already initialised in the test process")
    yield
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if ours:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny untied Qwen3 (q/k norms, head_dim 32 != hidden / heads), 2 query groups for TP=2."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=301, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, intermediate_size=96, head_dim=32, tie_word_embeddings=False)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("qwen3") / "m"
    Qwen3ForCausalLM(Qwen3Config(**shape)).float().save_pretrained(out)
    return out


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _backend(model_dir: Path, **spec: float) -> object:
    from workers.backends.megatron import make_backend

    return make_backend(tiny_spec(model_dir, **spec), model_dir)  # type: ignore[arg-type]


def _hf_logprobs(model: torch.nn.Module, mb: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference [b, T] log-probs and entropy from a transformers model, in the backend's alignment."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask.long()).logits[:, :-1].float()  # type: ignore[attr-defined]
    logp = torch.log_softmax(logits, -1)
    keep = mb.attention_mask[:, 1:].float()  # type: ignore[attr-defined]
    lp = logp.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1) * keep  # type: ignore[attr-defined]
    ent = -(logp.exp() * logp).sum(-1) * keep
    zero = torch.zeros(lp.shape[0], 1)
    return torch.cat([zero, lp], 1), torch.cat([zero, ent], 1)


# ---------------------------------------------------------------- no megatron needed


def test_config_mapping_covers_qwen2_qwen3_and_llama() -> None:
    base = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    base |= dict(intermediate_size=128, vocab_size=100, rms_norm_eps=1e-6, hidden_act="silu")
    qwen2 = convert.shape_from_hf_config(
        {**base, "model_type": "qwen2", "rope_parameters": {"rope_theta": 1e6}}
    )
    assert (qwen2.qkv_bias, qwen2.qk_norm, qwen2.rope_theta, qwen2.head_dim) == (True, False, 1e6, 16)
    qwen3 = convert.shape_from_hf_config(
        {**base, "model_type": "qwen3", "head_dim": 32, "attention_bias": False}
    )
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    llama = convert.shape_from_hf_config(
        {
            **base,
            "model_type": "llama",
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "rope_theta": 500000.0,
        }
    )
    assert (llama.qkv_bias, llama.qk_norm, llama.llama3_rope_scaling, llama.rope_theta) == (
        False,
        False,
        32.0,
        5e5,
    )
    with pytest.raises(ValueError, match="model_type 'mistral' is not supported"):
        convert.shape_from_hf_config({**base, "model_type": "mistral"})
    with pytest.raises(ValueError, match="llama3 rope scaling"):
        convert.shape_from_hf_config(
            {
                **base,
                "model_type": "llama",
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0},
            }
        )


def _random_hf(shape: convert.ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    s, d = shape, shape.head_dim
    sizes = {
        "model.embed_tokens.weight": (s.vocab_size, s.hidden_size),
        "model.norm.weight": (s.hidden_size,),
    }
    if not s.tie_word_embeddings:
        sizes["lm_head.weight"] = (s.vocab_size, s.hidden_size)
    for name in convert.hf_names(s):
        if ".layers." in name:
            kind = name.split(".")[-2]
            rows = {
                "q_proj": s.num_heads * d,
                "k_proj": s.num_query_groups * d,
                "v_proj": s.num_query_groups * d,
            }
            if kind in rows:
                sizes[name] = (rows[kind], s.hidden_size) if name.endswith("weight") else (rows[kind],)
            elif kind in ("gate_proj", "up_proj"):
                sizes[name] = (s.ffn_hidden_size, s.hidden_size)
            elif kind == "down_proj":
                sizes[name] = (s.hidden_size, s.ffn_hidden_size)
            elif kind == "o_proj":
                sizes[name] = (s.hidden_size, s.num_heads * d)
            elif kind in ("q_norm", "k_norm"):
                sizes[name] = (d,)
            else:
                sizes[name] = (s.hidden_size,)
    return {k: torch.randn(v, generator=g) for k, v in sizes.items()}


def test_conversion_round_trip_is_exact(model_dir: Path) -> None:
    """HF -> Megatron -> TP shards -> gathered -> HF gives back every tensor bit for bit: the tiny
    Qwen2 (tied, qkv bias) and a Qwen3-shaped model (untied, qk-norm, no bias, vocab not divisible)."""
    tiny = convert.shape_from_hf_config(json.loads((model_dir / "config.json").read_text()))
    qwen3 = convert.ModelShape("qwen3", 2, 32, 4, 2, 16, 48, 671, 64, 1e6, 1e-6, False, True, False)
    for shape, hf in ((tiny, load_file(str(model_dir / "model.safetensors"))), (qwen3, _random_hf(qwen3))):
        assert set(hf) == set(convert.hf_names(shape))
        for tp in (1, 2):
            full = convert.hf_to_megatron(hf, shape, tp)
            shards = [convert.shard(full, r, tp) for r in range(tp)]
            gathered = {name: convert.unshard(name, [s[name] for s in shards]) for name in full}
            back = convert.megatron_to_hf(gathered, shape)
            assert sorted(back) == sorted(hf)
            for name, t in hf.items():
                assert torch.equal(back[name], t), f"{shape.model_type} tp={tp}: {name}"
        # two pipeline stages: each holds its layers under local names (and the last stage a copy of
        # tied embeddings as its output layer); renamed back, the stages cover the model exactly
        full = convert.hf_to_megatron(hf, shape)
        stages = [convert.stage_tensors(full, shape, i, 1, i == 0, i == 1) for i in range(2)]
        assert all(all(".layers.0." in n for n in st if ".layers." in n) for st in stages)
        assert ("output_layer.weight" in stages[1]) and "output_layer.weight" not in stages[0]
        if shape.tie_word_embeddings:
            assert stages[1].pop("output_layer.weight") is full["embedding.word_embeddings.weight"]
        merged = {convert.global_layer_name(n, i): t for i, st in enumerate(stages) for n, t in st.items()}
        assert merged.keys() == full.keys() and all(merged[n] is full[n] for n in full)


def test_pp_must_divide_the_number_of_layers(model_dir: Path) -> None:
    from streamrl.errors import ConfigError
    from workers.backends.megatron import make_backend

    with pytest.raises(ConfigError, match="learner.pp: 3 does not divide the model's 2 layers"):
        make_backend(tiny_spec(model_dir, pp=3), model_dir)


def test_compat_refuses_an_unknown_megatron_version(monkeypatch: pytest.MonkeyPatch) -> None:
    real = megatron_compat.importlib.metadata.version
    monkeypatch.setattr(
        megatron_compat.importlib.metadata,
        "version",
        lambda name: "0.17.0" if name == "megatron-core" else real(name),
    )
    with pytest.raises(
        megatron_compat.MegatronVersionError,
        match=r"written for megatron-core 0\.16\.1.*found megatron-core 0\.17\.0",
    ):
        megatron_compat.check_versions()


def test_vocab_parallel_logprobs_gradients_are_exact_in_float64() -> None:
    from workers.backends.vocab_parallel import vocab_parallel_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    target = torch.randint(0, 7, (5,), generator=g)
    lp, ent = vocab_parallel_logprobs(logits, target, 0, None, entropy_grad=True)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, ref.gather(1, target[:, None]).squeeze(1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    assert torch.autograd.gradcheck(lambda x: vocab_parallel_logprobs(x, target, 0, None, True), (logits,))
    assert not vocab_parallel_logprobs(logits, target, 0, None)[1].requires_grad  # detached unless asked


# ---------------------------------------------------------------- TP=1 in this process


def test_logprobs_entropy_and_gradients_match_transformers(model_dir: Path, world_of_one: None) -> None:
    """Forward against transformers to 1e-4; then one step of PPO + entropy bonus: the gradient of
    every weight (megatron's main_grad, converted to HF names) and its norm match transformers'."""
    from transformers import AutoModelForCausalLM

    backend = _backend(model_dir, grad_clip=1e9)  # no clipping: main_grad stays the raw gradient
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    mbs = step_batches(_vocab(model_dir))[0]
    for mb in mbs:
        lp, ent = backend.logprobs_and_entropy(mb)  # type: ignore[attr-defined]
        with torch.no_grad():
            ref_lp, ref_ent = _hf_logprobs(hf, mb)
        assert lp[:, 0].eq(0).all() and lp[~mb.attention_mask].eq(0).all()
        torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
        torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=0)
    ref_loss = 0.0
    for mb in mbs:
        loss, _ = bonus_loss_fn(mb, *_hf_logprobs(hf, mb))
        loss.backward()
        ref_loss += float(loss.detach())
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    ref_norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()])))

    metrics = backend.train_step(mbs, bonus_loss_fn)  # type: ignore[attr-defined]
    assert metrics["loss"] * len(mbs) == pytest.approx(ref_loss, abs=1e-5)  # mean of the micro-batch losses
    assert metrics["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
    assert metrics["lr"] == pytest.approx(0.5e-3)  # warmup 2: step 1 of 2
    main_grads = {n: p.main_grad for n, p in backend.module.named_parameters()}  # type: ignore[attr-defined]
    grads = convert.megatron_to_hf(main_grads, backend.shape)  # type: ignore[attr-defined]
    assert sorted(grads) == sorted(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=1e-5, rtol=1e-3, msg=name)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_qwen3_and_llama_logprobs_match_transformers(family: str, world_of_one: None, tmp_path: Path) -> None:
    """Qwen3 (qk-norm, head_dim != hidden/heads, no qkv bias) and Llama 3.1 (rope scaling), both with
    untied embeddings, through the same conversion and backend."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        vocab_size=301, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    shape |= dict(intermediate_size=96, max_position_embeddings=16384, tie_word_embeddings=False)
    torch.manual_seed(0)
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=32, rope_theta=1e6))
    else:
        scaling = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
        scaling |= dict(original_max_position_embeddings=8192)
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_scaling=scaling, rope_theta=500000.0))
    model.float().save_pretrained(tmp_path)
    backend = _backend(tmp_path)
    mb = micro_batch(301, [200, 120], 2, seed=0)
    with torch.no_grad():
        torch.testing.assert_close(backend.logprobs(mb), _hf_logprobs(model, mb)[0], atol=1e-4, rtol=0)  # type: ignore[attr-defined]
    weights = dict(backend.hf_weights())  # type: ignore[attr-defined]
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_hf_weights_and_export_are_exact_and_load_in_transformers(
    model_dir: Path, world_of_one: None, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = _backend(model_dir)
    original = load_file(str(model_dir / "model.safetensors"))
    weights = dict(backend.hf_weights())  # type: ignore[attr-defined]
    assert sorted(weights) == sorted(original)
    assert all(torch.equal(weights[k], original[k]) for k in original)

    backend.train_step(step_batches(_vocab(model_dir))[0], loss_fn)  # type: ignore[attr-defined]
    backend.export_hf(tmp_path / "export")  # type: ignore[attr-defined]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert AutoTokenizer.from_pretrained(tmp_path / "export").vocab_size > 0
    trained = dict(backend.hf_weights())  # type: ignore[attr-defined]
    state = exported.state_dict()
    assert all(torch.equal(state[k], trained[k]) for k in trained), (
        "exported weights differ from the learner's"
    )
    mb = micro_batch(_vocab(model_dir), [14, 7], 2, seed=99)
    with torch.no_grad():
        torch.testing.assert_close(backend.logprobs(mb), _hf_logprobs(exported, mb)[0], atol=1e-4, rtol=0)  # type: ignore[attr-defined]


def test_save_then_load_continues_exactly(model_dir: Path, world_of_one: None, tmp_path: Path) -> None:
    batches = step_batches(_vocab(model_dir))
    first = _backend(model_dir)
    first.train_step(batches[0], loss_fn)  # type: ignore[attr-defined]
    first.save(tmp_path / "ckpt")  # type: ignore[attr-defined]

    def step(backend: object, mbs: list[MicroBatch]) -> dict[str, float]:
        metrics = backend.train_step(mbs, loss_fn)  # type: ignore[attr-defined]
        metrics.pop("train_step_s")
        return metrics

    expected = [step(first, b) for b in batches[1:]]
    expected_weights = dict(first.hf_weights())  # type: ignore[attr-defined]

    resumed = _backend(model_dir)  # fresh weights, optimizer and schedule
    resumed.load(tmp_path / "ckpt")  # type: ignore[attr-defined]
    got = [step(resumed, b) for b in batches[1:]]
    assert got == expected  # loss, entropy, grad norm and lr, bit for bit
    assert all(torch.equal(w, expected_weights[k]) for k, w in resumed.hf_weights())  # type: ignore[attr-defined]


# ---------------------------------------------------------------- TP=2 in two processes


def _assert_same_run(got: dict, want: dict, keys: tuple[str, ...], what: str) -> None:
    torch.testing.assert_close(got["before"], want["before"], atol=1e-5, rtol=0, msg=what)
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        for k in keys:
            assert g[k] == pytest.approx(w[k], abs=1e-5, rel=1e-5), f"{what} step {step + 1}: {k}"
    torch.testing.assert_close(got["after"], want["after"], atol=1e-5, rtol=0, msg=what)
    assert sorted(got["weights"]) == sorted(want["weights"])
    for k, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][k], w, atol=1e-5, rtol=0, msg=f"{what}: {k}")


@pytest.mark.slow
def test_tp2_dp2_and_pp2_over_two_processes_match_tp1(
    model_dir: Path, qwen3_dir: Path, world_of_one: None, tmp_path: Path
) -> None:
    """Two real gloo processes run the same three steps as TP=2, then as TP=1 x DP=2 (each rank one
    of the two micro-batches), then as two pipeline stages (megatron's 1F1B schedule over gloo p2p,
    micro-batches of different shapes, tied embeddings split between the stages); all match TP=1 in
    this process: log-probs, loss, entropy, grad norm, lr, and the trained weights. Both pipeline
    ranks return the same metrics and log-probs; the PP=2 export loads in transformers with the
    trained weights, and a PP=2 backend resumed from its checkpoint takes the same next step. Last, a
    Qwen3 at TP=2 matches its TP=1 run: its q/k norm weights are replicated but each TP rank sees
    only its heads, so their gradients must be summed over TP (megatron's finalize_model_grads)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "results.pt"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    cmd = [
        sys.executable,
        "-m",
        "tests.workers.backends._megatron_worker",
        "--model",
        str(model_dir),
        "--out",
        str(out),
        "--qwen3",
        str(qwen3_dir),
    ]
    procs = []
    for rank in range(2):
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed right after Popen
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env={**env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT
            )
        )
        log.close()
    try:
        tp1 = run_steps(_backend(model_dir), _vocab(model_dir))  # while the two ranks import megatron
        qwen3_tp1 = run_steps(_backend(qwen3_dir), _vocab(qwen3_dir))
        for rank, p in enumerate(procs):
            rc = p.wait(timeout=240)
            assert rc == 0, f"rank {rank} exited {rc}:\n" + (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    finally:
        for p in procs:
            stop_process(p)
    results = torch.load(out, weights_only=False)
    _assert_same_run(results["tp2"], tp1, ("loss", "entropy", "grad_norm", "lr", "tokens"), "TP=2")
    _assert_same_run(results["dp2"], tp1, ("grad_norm", "lr"), "DP=2")
    keys = ("loss", "entropy", "grad_norm", "lr", "tokens", "micro_batches")
    pp2 = results["pp2"]
    _assert_same_run(pp2, tp1, keys, "PP=2")
    last_stage = torch.load(out.with_suffix(".rank1.pt"), weights_only=False)["pp2"]
    assert last_stage["steps"] == pp2["steps"]  # the last stage's metrics, on the first stage too
    assert torch.equal(last_stage["before"], pp2["before"]) and torch.equal(last_stage["after"], pp2["after"])
    assert last_stage["weights"] == {}  # weights are yielded on global rank 0 only
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "pp2_export").state_dict()
    assert all(torch.equal(exported[k], w) for k, w in pp2["weights"].items())
    assert pp2["resumed_step"] == pp2["next_step"]
    assert all(torch.equal(w, pp2["next_weights"][k]) for k, w in pp2["resumed_weights"].items())
    qwen3 = results["qwen3_tp2"]
    _assert_same_run({**qwen3, "weights": {}}, {**qwen3_tp1, "weights": {}}, keys, "Qwen3 TP=2")
    for k, w in qwen3_tp1["weights"].items():  # Adam's first steps amplify fp32 rounding on the norms
        torch.testing.assert_close(qwen3["weights"][k], w, atol=5e-5, rtol=0, msg=f"Qwen3 TP=2: {k}")


def test_a_non_finite_gradient_skips_the_update(model_dir: Path, world_of_one: None) -> None:
    backend = _backend(model_dir)
    before = {k: v.clone() for k, v in backend.hf_weights()}  # type: ignore[attr-defined]

    def nan_loss(
        mb: MicroBatch, logprobs: torch.Tensor, entropy: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return (logprobs * float("nan")).sum(), {}

    metrics = backend.train_step(step_batches(_vocab(model_dir))[0], nan_loss)  # type: ignore[attr-defined]
    assert metrics["update_skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    assert all(torch.equal(w, before[k]) for k, w in backend.hf_weights())  # type: ignore[attr-defined]
    assert backend.train_step(step_batches(_vocab(model_dir))[0], loss_fn)["lr"] == pytest.approx(0.5e-3)  # type: ignore[attr-defined]
