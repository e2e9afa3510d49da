"""Prompt sources read the published formats; the cursor is a pure function of its position."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from streamrl.config import DataConfig, JsonlData, ParquetData, SyntheticArithData
from streamrl.data import Cursor, make_source, train_source
from streamrl.errors import ConfigError


def test_rlinf_jsonl_rows_become_prompts(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    rows = [
        {
            "prompt": [{"content": "Solve 1+1.", "role": "user"}],
            "task": "math",
            "query_id": "00000042",
            "solutions": ["2"],
        },
        {
            "prompt": "<|User|>\nWhat is 3*3? Please reason step by step.<|Assistant|><think>\n",
            "task": "math",
            "query_id": "7",
            "solutions": "\\boxed{9}",
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    src = make_source(JsonlData(path=str(path)))
    assert len(src) == 2
    a, b = src[0], src[1]
    assert a.prompt_id == "00000042" and a.answer == "2" and a.messages[0].content == "Solve 1+1."
    assert a.meta == {"task": "math"}
    assert b.text.startswith("<|User|>") and b.answer == "\\boxed{9}" and b.messages is None


def test_jsonl_errors_name_file_line_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "x", "solutions": ["1"]}\n{"prompt": "y"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: missing key 'solutions'"):
        make_source(JsonlData(path=str(path)))
    path.write_text('{"prompt": "x", "solutions": ["1"]}\nnot json\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl:2: invalid JSON"):
        make_source(JsonlData(path=str(path)))
    with pytest.raises(ConfigError, match="cannot read"):
        make_source(JsonlData(path=str(tmp_path / "missing.jsonl")))


def test_rstar2_parquet_rows_become_prompts(tmp_path: Path) -> None:
    path = tmp_path / "train.parquet"
    rows = [
        {
            "data_source": "rstar_dapo",
            "agent_name": "rstar2_agent",
            "prompt": [{"role": "user", "content": f"question {i}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(10 + i)},
            "extra_info": {
                "split": "train",
                "index": i,
                "answer": str(10 + i),
                "question": f"question {i}",
                "need_tools_kwargs": False,
            },
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    src = make_source(ParquetData(path=str(path)))
    assert len(src) == 3
    item = src[2]
    assert (item.prompt_id, item.answer, item.messages[0].content) == ("2", "12", "question 2")
    assert item.meta["agent_name"] == "rstar2_agent"


def test_synthetic_arithmetic_is_deterministic_and_correct() -> None:
    src = make_source(SyntheticArithData(size=50, digits=3, ops="+-*", seed=4))
    again = make_source(SyntheticArithData(size=50, digits=3, ops="+-*", seed=4))
    for i in range(50):
        item = src[i]
        assert item == again[i]
        a, op, b = next(
            (item.text[:k], item.text[k], item.text[k + 1 : -1])
            for k in range(1, len(item.text))
            if item.text[k] in "+-*"
        )
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999
        assert int(item.answer) == eval(f"{a}{op}{b}")  # noqa: S307 - our own generated text
    assert src[0] != make_source(SyntheticArithData(size=50, digits=3, ops="+-*", seed=5))[0]


def test_cursor_visits_every_item_once_per_epoch_in_a_seeded_order() -> None:
    cur = Cursor(10, shuffle=True, seed=3)
    first = [cur.index(p) for p in range(10)]
    second = [cur.index(p) for p in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second  # reshuffled each epoch
    assert [
        Cursor(10, True, 3).index(p) for p in range(20)
    ] == first + second  # restorable from position alone
    assert [Cursor(4, False, 0).index(p) for p in range(6)] == [0, 1, 2, 3, 0, 1]


def test_train_source_uses_the_data_section() -> None:
    src, cur = train_source(DataConfig(train=SyntheticArithData(size=7), shuffle=False))
    assert len(src) == 7 and cur.index(8) == 1
