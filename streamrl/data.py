"""Prompt sources: RLinf jsonl, rStar2/verl parquet, and built-in synthetic arithmetic.

A source is a random-access sequence of `PromptItem`s. The buffer owns one cursor over it: cursor
position k maps to item `order(epoch)[k % len]`, where the order is a seeded permutation per epoch
(or identity). The cursor alone therefore restores the exact position after a snapshot.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from streamrl.config import DataConfig, DataSource, JsonlData, ParquetData, SyntheticArithData
from streamrl.errors import ConfigError
from streamrl.messages import ChatMessage


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    answer: str
    messages: list[ChatMessage] | None = None
    text: str | None = None
    meta: dict[str, str] = field(default_factory=dict)


class PromptSource(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> PromptItem: ...


def _prompt_fields(value: Any, where: str) -> tuple[list[ChatMessage] | None, str | None]:
    if isinstance(value, str):
        return None, value
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        return [ChatMessage(role=str(m["role"]), content=str(m["content"])) for m in value], None
    raise ConfigError(f"{where}: prompt must be a string or a list of {{role, content}} messages")


def _answer(value: Any, where: str) -> str:
    # RLinf wraps a single answer into a list and only ever grades solutions[0].
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"{where}: empty answer list")
        value = value[0]
    if value is None:
        raise ConfigError(f"{where}: missing answer")
    return str(value)


class JsonlSource:
    """RLinf's format: one JSON object per line with prompt, query_id and solutions."""

    def __init__(self, cfg: JsonlData) -> None:
        self.items: list[PromptItem] = []
        path = Path(cfg.path)
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise ConfigError(f"data: cannot read {path}: {e.strerror}") from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where}: invalid JSON: {e.msg}") from None
            for key in (cfg.prompt_key, cfg.answer_key):
                if key not in row:
                    raise ConfigError(f"{where}: missing key {key!r}")
            messages, text = _prompt_fields(row[cfg.prompt_key], where)
            pid = str(row.get(cfg.id_key, len(self.items)))
            meta = {k: str(row[k]) for k in ("task",) if k in row}
            self.items.append(PromptItem(pid, _answer(row[cfg.answer_key], where), messages, text, meta))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]


class ParquetSource:
    """rStar2/verl parquet: prompt=[messages], reward_model.ground_truth, extra_info.index."""

    def __init__(self, cfg: ParquetData) -> None:
        import pyarrow.parquet as pq  # heavy; only parquet jobs pay for it

        try:
            rows = pq.read_table(cfg.path).to_pylist()
        except (OSError, ValueError) as e:
            raise ConfigError(f"data: cannot read parquet {cfg.path}: {e}") from None
        self.items = []
        for i, row in enumerate(rows):
            where = f"{cfg.path} row {i}"
            if "prompt" not in row or "reward_model" not in row:
                raise ConfigError(f"{where}: expected columns prompt and reward_model")
            messages, text = _prompt_fields(row["prompt"], where)
            extra = row.get("extra_info") or {}
            pid = str(extra.get("index", i))
            meta = {k: str(row[k]) for k in ("data_source", "agent_name", "ability") if row.get(k)}
            answer = _answer((row["reward_model"] or {}).get("ground_truth"), where)
            self.items.append(PromptItem(pid, answer, messages, text, meta))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]


ARITH_INSTRUCTION = "Put the final answer in \\boxed{}."


class SyntheticArithSource:
    """Arithmetic problems over `digits`-digit operands; item i is a pure function of (seed, i)."""

    def __init__(self, cfg: SyntheticArithData) -> None:
        bad = set(cfg.ops) - set("+-*")
        if bad or not cfg.ops:
            raise ConfigError(f"data: synthetic_arith ops must use + - *, got {cfg.ops!r}")
        self.cfg = cfg

    def __len__(self) -> int:
        return self.cfg.size

    def __getitem__(self, index: int) -> PromptItem:
        if not 0 <= index < self.cfg.size:
            raise IndexError(index)
        rng = random.Random(self.cfg.seed * 1_000_003 + index)
        lo, hi = 10 ** (self.cfg.digits - 1) if self.cfg.digits > 1 else 0, 10**self.cfg.digits - 1
        a, b, op = rng.randint(lo, hi), rng.randint(lo, hi), rng.choice(self.cfg.ops)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        question = f"{a}{op}{b}="
        return PromptItem(
            prompt_id=f"arith-{self.cfg.seed}-{index}",
            answer=str(result),
            text=question,
            meta={"question": question},
        )


def make_source(cfg: DataSource) -> PromptSource:
    if isinstance(cfg, JsonlData):
        return JsonlSource(cfg)
    if isinstance(cfg, ParquetData):
        return ParquetSource(cfg)
    return SyntheticArithSource(cfg)


class Cursor:
    """Maps a monotonically increasing position to dataset indices, epoch by epoch."""

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        if size == 0:
            raise ConfigError("data: the training set is empty")
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self._epoch = -1
        self._order: np.ndarray | None = None

    def index(self, position: int) -> int:
        epoch, offset = divmod(position, self.size)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            self._epoch = epoch
        assert self._order is not None
        return int(self._order[offset])


def train_source(cfg: DataConfig) -> tuple[PromptSource, Cursor]:
    source = make_source(cfg.train)
    return source, Cursor(len(source), cfg.shuffle, cfg.seed)
