"""Tiny CPU models: the tokenizer survives transformers' Qwen2 class swap, folders load, builds cache.

No full warm start runs here: builds get a budget of a few seconds and are checked for what they write,
not for how well the model learned (the real builds are measured by `streamrl tiny build`).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl import templates, tiny, tiny_data
from streamrl.cli import main as cli_main
from streamrl.tiny_train import EvalResult, _roll_back, copy_prior_init, encode, evaluate, sft_loss

ROUND_TRIP = [
    "a  b   c",
    "line\n\nnext\r\n  indented\tTab",
    "12345*6789= 83810205 007",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "unicode: héllo naïve 日本語 😀 ∑ ±",
    ' {"code": "print(1)\\n", "input": ""} ',
    "trailing spaces   ",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny.random_model_dir(tmp_path_factory.mktemp("tiny") / "random", seed=3)


def test_tokenizer_round_trips_text_through_autotokenizer_despite_the_qwen2_class_swap(
    model_dir: Path,
) -> None:
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == "qwen2"
    tok = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in ROUND_TRIP:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        # The class transformers picked and the file agree token for token.
        assert ids == raw.encode(text, add_special_tokens=False).ids


def test_digits_are_split_one_by_one_like_qwen2(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert tok.tokenize("2025") == ["2", "0", "2", "5"]


def test_special_tokens_are_single_ids_and_eos_pad_are_chatml(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in templates.SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == 3
    assert tok.eos_token == templates.IM_END and tok.pad_token == templates.EOT


def test_bpe_compresses_the_rstar2_system_prompt(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt = templates.rstar2_prompt(None, "1234*5678=")
    # Qwen2's regex keeps words apart, so ~330 pre-tokens is the floor; bytes would be ~1450.
    assert len(tok(prompt, add_special_tokens=False)["input_ids"]) < 360


def test_random_model_dir_loads_with_automodel_and_generates(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.tie_word_embeddings and model.dtype == torch.float32
    assert model.config.eos_token_id == tok.convert_tokens_to_ids(templates.IM_END)
    ids = tok(templates.math_prompt(None, "1+2="), return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, ids.shape[1] + 5)


def test_shared_prefix_loss_equals_the_full_sequence_loss(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    stream = tiny_data.train_stream("tool", 0, set())
    examples = [next(stream) for _ in range(3)]
    batch = encode(tok, examples)
    assert batch.prefix.shape[1] > 300  # the rStar2 system prompt is shared
    total, count = 0.0, 0
    for ex in examples:  # reference: plain forward over each whole sequence
        ids, labels = [], []
        for text, trained in ex.segments:
            seg = tok(text, add_special_tokens=False)["input_ids"]
            ids += seg
            labels += seg if trained else [-100] * len(seg)
        logits = model(torch.tensor([ids])).logits[0, :-1]
        target = torch.tensor(labels[1:])
        total += float(
            torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum").detach()
        )
        count += int((target != -100).sum())
    assert float(sft_loss(model, batch).detach()) == pytest.approx(total / count, rel=1e-4)


def test_synthetic_sft_data_is_a_pure_function_of_the_seed() -> None:
    def first(task: tiny_data.Task, seed: int) -> list[tiny_data.Example]:
        held = {str(it.text) for it in tiny_data.heldout(task, seed, 50)}
        stream = tiny_data.train_stream(task, seed, held)
        return [next(stream) for _ in range(200)]

    for task in tiny_data.TASKS:
        assert first(task, 1) == first(task, 1)
        assert first(task, 1) != first(task, 2)
        held = {str(it.text) for it in tiny_data.heldout(task, 1, 50)}
        assert not held & {ex.question for ex in first(task, 1)}


def test_tool_example_trains_on_assistant_turns_and_masks_the_tool_response() -> None:
    stream = tiny_data.train_stream("tool", 0, set(), direct_fraction=0.0)
    ex = next(stream)
    (prompt, p), (call, c), (tool, t), (final, f) = ex.segments
    assert (p, c, t, f) == (False, True, False, True)
    assert prompt.endswith("<|im_start|>assistant\n<reason>") and call.endswith(templates.IM_END)
    code = tiny_data.parse_tool_call(call)
    assert code is not None and code.startswith("print(")
    result = tiny_data.run_formulaic(code)
    assert result.stdout == ex.answer + "\n"
    assert tool.startswith(f"<|im_start|>user\n<tool_response>\nTool call success\nstdout: {ex.answer}\n\n")
    assert f"</reason> <answer> \\boxed{{{ex.answer}}} </answer>{templates.IM_END}" in final
    assert tiny_data.last_boxed(final) == ex.answer


def test_formulaic_runner_refuses_anything_but_printed_integer_arithmetic() -> None:
    assert tiny_data.run_formulaic("print(12*-3+4)").stdout == "-32\n"
    for code in [
        "import os\nprint(1)",
        "print(2**99999)",
        "print(1, 2)",
        "open('x')",
        "print(1.5*2)",
        "print((",
    ]:
        assert not tiny_data.run_formulaic(code).run_success


def test_cli_build_writes_a_loadable_folder_with_the_marker_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "arith"
    assert (
        cli_main(["tiny", "build", "--task", "arith", "--out", str(out), "--time-budget-s", "4", "--quiet"])
        == 0
    )
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    report = tiny.BuildReport.load(out)
    assert printed["steps"] == report.steps >= 1 and report.path == str(out)
    assert 0.0 <= report.heldout_accuracy <= 1.0 and report.history and report.wall_s < 30
    marker_mtime = (out / tiny.MARKER).stat().st_mtime_ns
    assert all(p.stat().st_mtime_ns <= marker_mtime for p in out.iterdir())
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "qwen2"


def test_ensure_rebuilds_a_half_written_folder_then_reuses_the_cache(tmp_path: Path) -> None:
    name = f"arith-{tiny.version_hash('arith', 0, 3.0)}"
    half = tmp_path / name
    half.mkdir()
    (half / "config.json").write_text("{}")  # a build that died before its marker
    path = tiny.ensure("arith", tmp_path, time_budget_s=3.0, progress=False)
    assert path == half and (path / tiny.MARKER).is_file()
    assert tiny.BuildReport.load(path).path == str(path)
    t0 = time.monotonic()
    assert tiny.ensure("arith", tmp_path, time_budget_s=3.0, progress=False) == path
    assert time.monotonic() - t0 < 1.0
    assert not list(tmp_path.glob(".*tmp*"))


def test_ensure_builds_once_when_called_concurrently(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The lock logic is under test, not training: a stand-in build that is slow and counts its calls.
    calls: list[Path] = []

    def fake_build(task: str, out_dir: Path, **_: object) -> tiny.BuildReport:
        calls.append(out_dir)
        time.sleep(0.3)
        out_dir.mkdir(parents=True)
        report = tiny.BuildReport(str(out_dir), task, 0, 1, 1, 0.3, 1.0, 0.25)
        (out_dir / tiny.MARKER).write_text(json.dumps(report.__dict__))
        return report

    monkeypatch.setattr(tiny, "build", fake_build)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(tiny.ensure("tool", tmp_path))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert len(calls) == 1 and len(results) == 3 and len(set(results)) == 1
    assert tiny.BuildReport.load(results[0]).path == str(results[0])


def test_default_cache_root_follows_streamrl_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("STREAMRL_CACHE", str(tmp_path))
    assert tiny.cache_root() == tmp_path / "tiny"
    monkeypatch.delenv("STREAMRL_CACHE")
    assert tiny.cache_root() == Path.home() / ".cache" / "streamrl" / "tiny"


def test_copy_prior_makes_each_last_layer_head_a_scaled_projection(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    copy_prior_init(model, 0.2)
    attn, cfg = model.model.layers[-1].self_attn, model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for h in range(cfg.num_attention_heads):
        kv = h // group
        m = (
            attn.o_proj.weight[:, h * hd : (h + 1) * hd] @ attn.v_proj.weight[kv * hd : (kv + 1) * hd]
        )  # (H, H)
        assert torch.allclose(m @ m, 0.2 * m, atol=1e-5) and torch.allclose(m, m.T, atol=1e-6)
        assert float(torch.trace(m)) == pytest.approx(0.2 * hd, rel=1e-4)  # rank hd: copies a subspace


def test_sampled_evaluation_is_reproducible_given_its_seed(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    items = tiny_data.heldout("arith", 0, 4)
    a, b = (evaluate(model, tok, "arith", items, temperature=1.0, seed=5) for _ in range(2))
    assert a.samples == b.samples
    assert evaluate(model, tok, "arith", items, temperature=1.0, seed=6).samples != a.samples


def test_rollback_finds_a_snapshot_inside_the_band_or_keeps_the_closest() -> None:
    model = torch.nn.Linear(1, 1, bias=False).requires_grad_(
        False
    )  # the weight stands for "the accuracy these weights get"

    def state(acc: float) -> dict[str, torch.Tensor]:
        return {"weight": torch.tensor([[acc]])}

    def check(_: int) -> EvalResult:
        return EvalResult(float(model.weight), None, None, [])

    snaps = [(5 * i, state(acc)) for i, acc in enumerate([0.0, 0.1, 0.3, 0.7], start=1)]
    model.load_state_dict(state(0.9))
    step, res = _roll_back(model, snaps, (25, check(25)), check, (0.2, 0.5), float("inf"), 0.0)
    assert (step, res.accuracy) == (15, pytest.approx(0.3)) and float(model.weight) == pytest.approx(0.3)
    snaps = [(5, state(0.1)), (10, state(0.55))]  # jumped over the band: keep what is closest to it
    model.load_state_dict(state(0.95))
    step, res = _roll_back(model, snaps, (15, check(15)), check, (0.2, 0.5), float("inf"), 0.0)
    assert step == 10 and float(model.weight) == pytest.approx(0.55)
