"""`streamrl export RUN_DIR`: the latest (or a chosen) learner checkpoint of a run becomes a Hugging
Face folder that transformers loads with exactly the checkpoint's weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from streamrl import checkpoint
from streamrl.cli import main as cli
from streamrl.config_load import load_job
from streamrl.tiny import random_model_dir
from workers.backends.hf import make_backend

JOB = """\
name: export-test
model: {{path: {model}, dtype: float32}}
data: {{train: {{type: synthetic_arith, size: 10}}}}
learner: {{backend: hf, lr: 0.01}}
"""


def test_export_writes_the_checkpointed_weights_as_a_transformers_folder(tmp_path: Path) -> None:
    model = random_model_dir(tmp_path / "model", seed=3)
    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text(JOB.format(model=model))
    b = make_backend(load_job(run / "job.yaml"), model)
    with torch.no_grad():
        for p in b.model.parameters():
            p.add_(0.01)  # a policy that differs from the initial model
    for step in (3, 7):
        d = checkpoint.step_dir(run, step)
        b.save(d / checkpoint.LEARNER)
        (d / checkpoint.BUFFER_SNAPSHOT).write_bytes(b"")
        checkpoint.mark_latest(run, step)
        with torch.no_grad():
            for p in b.model.parameters():
                p.add_(0.01)
    assert checkpoint.latest(run) == 7
    assert cli(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ours = dict(exported.named_parameters())
    for name, p in initial.named_parameters():
        assert torch.allclose(ours[name], p + 0.02, atol=1e-6), name  # step 7 = two shifts


def test_export_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["export", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
    assert "not a run directory (no job.yaml)" in capsys.readouterr().err
