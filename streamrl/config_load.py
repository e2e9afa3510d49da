"""Loading job specs: YAML -> overrides -> typed JobSpec -> cross-field rules.

Every failure is a ConfigError whose message starts with the source, the YAML line when known, and
the dotted key path, e.g.

    configs/tiny-arith.yaml:14: buffer.max_staleness: Expected `int` <= 64, got 90

Overrides (`--set buffer.max_staleness=2`) are parsed as YAML scalars and applied to the raw
document before typing, so they go through exactly the same checks as the file.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec
import yaml

from streamrl.config import JobSpec, SGLangEngine
from streamrl.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` (no dot) as a string; learning rates are written that way, so accept
    any decimal or exponent float, as YAML 1.2 does."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


_AT_PATH = re.compile(r"^(?P<msg>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)
_FIELD_IN_MSG = re.compile(r"(?:unknown|missing required) field `(?P<field>[^`]+)`")


def load_job(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """Read, override, type-check and cross-check a job spec file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    return parse_job(text, source=str(path), overrides=overrides)


def load_job_or_exit(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """For command-line entry points: the spec, or the error on stderr and exit status 2."""
    try:
        return load_job(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_job(text: str, source: str = "<job>", overrides: Iterable[str] = ()) -> JobSpec:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        raw = _yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{where}: invalid YAML: {problem}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: a job spec must be a mapping of sections, got {type(raw).__name__}")
    overridden: set[tuple[str | int, ...]] = set()
    for item in overrides:
        keys = apply_override(raw, item)
        overridden.add(keys)
    try:
        spec = msgspec.convert(raw, JobSpec, strict=True)
    except msgspec.ValidationError as e:
        keys, msg = _split_msgspec_error(str(e))
        raise ConfigError(_locate(source, root, keys, msg, overridden)) from None
    for keys, msg in cross_field_problems(spec):
        raise ConfigError(_locate(source, root, keys, msg, overridden))
    return spec


def apply_override(raw: dict[str, Any], item: str) -> tuple[str, ...]:
    """Apply one `a.b.c=value` override to the raw document; returns the key path."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE")
    keys = tuple(key.strip().split("."))
    try:
        parsed = _yaml(value) if value.strip() else None
    except yaml.YAMLError:
        parsed = value
    node: Any = raw
    for i, k in enumerate(keys[:-1]):
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(f"--set {item!r}: {'.'.join(keys[: i + 1])} is not a section")
        node = nxt
    node[keys[-1]] = parsed
    return keys


def dump_job(spec: JobSpec) -> str:
    """The fully resolved spec (defaults filled in) as YAML."""
    return yaml.safe_dump(msgspec.to_builtins(spec), sort_keys=False)


def cross_field_problems(spec: JobSpec) -> list[tuple[tuple[str, ...], str]]:
    """Rules that involve more than one field, as (key path, message) pairs."""
    problems: list[tuple[tuple[str, ...], str]] = []
    roc, rollout = spec.roc, spec.rollout
    if roc.enabled:
        if rollout.n_samples % roc.down_sample_to_n:
            problems.append(
                (
                    ("rollout", "n_samples"),
                    f"must be a multiple of roc.down_sample_to_n ({roc.down_sample_to_n}), "
                    f"got {rollout.n_samples}",
                )
            )
        if roc.min_zero_reward_trace_num + roc.min_non_zero_reward_trace_num > roc.down_sample_to_n:
            problems.append(
                (
                    ("roc", "min_zero_reward_trace_num"),
                    f"min_zero_reward_trace_num + min_non_zero_reward_trace_num "
                    f"({roc.min_zero_reward_trace_num} + {roc.min_non_zero_reward_trace_num}) "
                    f"must be <= down_sample_to_n ({roc.down_sample_to_n})",
                )
            )
    if rollout.concurrency < rollout.n_samples:
        problems.append(
            (
                ("rollout", "concurrency"),
                f"must be at least rollout.n_samples ({rollout.n_samples}): a group runs all its samples at once",
            )
        )
    if rollout.agent == "rstar2_tool" and spec.sandbox is None:
        problems.append((("sandbox",), "rollout.agent 'rstar2_tool' needs a sandbox section"))
    algo = spec.algorithm
    if algo.behaviour_weight_cap is not None and not algo.recompute_logprobs:
        problems.append(
            (
                ("algorithm", "behaviour_weight_cap"),
                "the decoupled loss needs proximal log-probs: set algorithm.recompute_logprobs: true",
            )
        )
    if algo.clip_low >= 1:
        problems.append((("algorithm", "clip_low"), f"must be < 1, got {algo.clip_low}"))
    gpus = spec.launcher.nodes * spec.launcher.gpus_per_node
    learner = spec.learner
    if gpus == 0:
        if spec.weight_sync.backend == "nccl":
            problems.append((("weight_sync", "backend"), "nccl needs GPUs (launcher.gpus_per_node > 0)"))
        if isinstance(spec.engine, SGLangEngine) and not spec.engine.urls:
            problems.append(
                (("engine", "type"), "sglang servers need GPUs: set launcher.gpus_per_node or engine.urls")
            )
    else:
        ranks = learner.tp * learner.pp * learner.dp
        engine_gpus = 0
        if isinstance(spec.engine, SGLangEngine) and not spec.engine.urls:
            engine_gpus = spec.engine.count * spec.engine.tp_size
        if ranks + engine_gpus > gpus:
            problems.append(
                (
                    ("learner", "dp"),
                    f"learner tp*pp*dp ({ranks}) + engine GPUs ({engine_gpus}) exceed the "
                    f"{gpus} GPUs of launcher.nodes x launcher.gpus_per_node",
                )
            )
    if spec.launcher.kind == "local" and spec.launcher.nodes > 1:
        problems.append((("launcher", "nodes"), "the local launcher runs on one host: use kind: ray"))
    if spec.eval.every_steps and spec.data.eval is None:
        problems.append((("eval", "every_steps"), "periodic evaluation needs data.eval"))
    return problems


def _split_msgspec_error(text: str) -> tuple[tuple[str | int, ...], str]:
    m = _AT_PATH.match(text)
    if not m:
        return (), text
    keys: list[str | int] = []
    for part in re.findall(r"\.([^.\[]+)|\[(\d+)\]", m["path"]):
        keys.append(part[0] if part[0] else int(part[1]))
    msg = m["msg"]
    field = _FIELD_IN_MSG.search(msg)
    if field:
        keys.append(field["field"])
    return tuple(keys), msg


def _locate(
    source: str,
    root: yaml.Node | None,
    keys: tuple[str | int, ...],
    msg: str,
    overridden: set[tuple[str | int, ...]],
) -> str:
    dotted = ".".join(str(k) for k in keys) or "(top level)"
    if any(keys[: len(o)] == o for o in overridden):
        return f"{source}: {dotted} (from --set): {msg}"
    line = _line_of(root, keys)
    where = f"{source}:{line}" if line else source
    return f"{where}: {dotted}: {msg}"


def _line_of(node: yaml.Node | None, keys: tuple[str | int, ...]) -> int | None:
    """1-based line of the deepest node of `keys` that exists in the YAML tree."""
    line = node.start_mark.line + 1 if node is not None else None
    for key in keys:
        if isinstance(node, yaml.MappingNode) and isinstance(key, str):
            for k_node, v_node in node.value:
                if k_node.value == key:
                    line, node = k_node.start_mark.line + 1, v_node
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            return line
    return line
