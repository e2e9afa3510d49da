"""Job specs: every shipped config loads, and bad input names the key path and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.cli import main as cli
from streamrl.config_load import dump_job, load_job, parse_job
from streamrl.errors import ConfigError

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
TINY = next(p for p in CONFIGS if p.name == "tiny-arith.yaml")


def test_there_are_shipped_configs_including_the_recipes() -> None:
    names = {p.name for p in CONFIGS}
    assert {
        "tiny-arith.yaml",
        "rlinf-rstar2-qwen2.5-7b.yaml",
        "rstar2-agent-qwen3-14b.yaml",
        "rlinf-math-grpo-r1-distill-1.5b.yaml",
    } <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path: Path) -> None:
    spec = load_job(path)
    # The resolved dump is itself a valid spec that resolves to the same thing.
    assert parse_job(dump_job(spec)) == spec


def test_recipes_carry_the_published_hyperparameters() -> None:
    rstar = load_job(CONFIGS[[p.name for p in CONFIGS].index("rstar2-agent-qwen3-14b.yaml")])
    assert (rstar.rollout.n_samples, rstar.roc.down_sample_to_n) == (32, 16)
    assert (rstar.algorithm.clip_low, rstar.algorithm.clip_high, rstar.learner.lr) == (0.2, 0.28, 1e-6)
    math = load_job(CONFIGS[[p.name for p in CONFIGS].index("rlinf-math-grpo-r1-distill-1.5b.yaml")])
    assert math.reward.type == "rlinf_pm5" and math.algorithm.early_stop_imp_ratio == 5.0
    assert math.group_size == 16 and rstar.group_size == 16


def _error(text: str, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        parse_job(text, "job.yaml", overrides)
    return str(info.value)


TEXT = TINY.read_text()


def test_a_wrong_type_names_the_key_path_and_line() -> None:
    msg = _error(TEXT.replace("max_staleness: 1", 'max_staleness: "two"'))
    line = TEXT.splitlines().index("  max_staleness: 1") + 1
    assert msg == f"job.yaml:{line}: buffer.max_staleness: Expected `int`, got `str`"


def test_an_unknown_key_is_rejected_with_its_own_line() -> None:
    lr = next(x for x in TEXT.splitlines() if x.startswith("  lr: "))
    msg = _error(TEXT.replace(lr, lr + "\n  lrr: 2"))
    line = TEXT.splitlines().index(lr) + 2
    assert msg == f"job.yaml:{line}: learner.lrr: Object contains unknown field `lrr`"


def test_a_value_out_of_range_is_rejected() -> None:
    assert "buffer.max_staleness: Expected `int` <= 64" in _error(
        TEXT.replace("max_staleness: 1", "max_staleness: 90")
    )
    assert "rollout.n_samples: Expected `int` >= 1" in _error(TEXT.replace("n_samples: 8", "n_samples: 0"))


def test_an_unknown_variant_tag_is_rejected() -> None:
    msg = _error(TEXT.replace("engine: {type: embedded", "engine: {type: vllm"))
    assert "engine.type: Invalid value 'vllm'" in msg


def test_n_samples_must_be_a_multiple_of_down_sample_to_n() -> None:
    text = TEXT.replace("n_samples: 8", "n_samples: 12") + "roc: {enabled: true, down_sample_to_n: 8}\n"
    line = TEXT.splitlines().index("  n_samples: 8") + 1
    assert _error(text) == (
        f"job.yaml:{line}: rollout.n_samples: must be a multiple of roc.down_sample_to_n (8), got 12"
    )


def test_roc_minimums_must_fit_in_the_down_sampled_group() -> None:
    text = TEXT + "roc: {enabled: true, down_sample_to_n: 4, min_zero_reward_trace_num: 3}\n"
    assert (
        "roc.min_zero_reward_trace_num: min_zero_reward_trace_num + min_non_zero_reward_trace_num (3 + 2)"
        in _error(text)
    )


def test_tool_agent_without_a_sandbox_is_rejected() -> None:
    assert "sandbox: rollout.agent 'rstar2_tool' needs a sandbox" in _error(
        TEXT.replace("agent: math", "agent: rstar2_tool")
    )


def test_model_needs_exactly_one_of_path_and_tiny() -> None:
    msg = _error(TEXT.replace("  tiny: arith\n", "  tiny: arith\n  path: /m\n"))
    assert "model: set exactly one of `path` and `tiny`" in msg


def test_invalid_yaml_reports_the_line() -> None:
    assert _error("name: x\nmodel: [1,\n").startswith("job.yaml:3: invalid YAML")


def test_overrides_are_typed_like_the_file_and_say_they_came_from_set() -> None:
    spec = parse_job(TEXT, "job.yaml", ["buffer.max_staleness=2", "rollout.temperature=0.7"])
    assert spec.buffer.max_staleness == 2 and spec.rollout.temperature == 0.7
    assert _error(TEXT, "buffer.max_staleness=lots") == (
        "job.yaml: buffer.max_staleness (from --set): Expected `int`, got `str`"
    )
    assert "expected KEY.PATH=VALUE" in _error(TEXT, "buffer.max_staleness")


def test_exponent_floats_without_a_dot_are_numbers_in_files_and_overrides() -> None:
    # YAML 1.1 would read 1e-4 as a string and reject a perfectly ordinary learning rate.
    lr = next(x for x in TEXT.splitlines() if x.startswith("  lr: "))
    spec = parse_job(TEXT.replace(lr, "  lr: 1e-4"), "job.yaml", ["algorithm.clip_high=2.8e-1"])
    assert spec.learner.lr == 1e-4 and spec.algorithm.clip_high == 0.28
    assert parse_job(TEXT, "job.yaml", ["learner.lr=3e-5"]).learner.lr == 3e-5


def test_an_override_can_switch_a_tagged_variant() -> None:
    spec = parse_job(TEXT, "job.yaml", ["sandbox.type=code_judge", "sandbox.url=http://127.0.0.1:1"])
    assert spec.sandbox is not None and spec.sandbox.url == "http://127.0.0.1:1"


def test_cli_validate_exits_zero_or_nonzero_with_a_clear_error(tmp_path: Path, capsys) -> None:
    assert cli(["validate", str(TINY)]) == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(TEXT.replace("groups_per_step: 8", "groups_per_step: -1"))
    with pytest.raises(SystemExit) as exited:
        cli(["validate", str(bad)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "buffer.groups_per_step: Expected `int` >= 1" in err and str(bad) in err


def test_cli_print_config_shows_defaults_and_overrides(capsys) -> None:
    assert cli(["print-config", str(TINY), "--set", "buffer.max_staleness=3"]) == 0
    out = capsys.readouterr().out
    assert "max_staleness: 3" in out and "bucket_mb: 64" in out and "grpo_eps: 1.0e-06" in out
