"""Request validation for the Code Judge-compatible server, with FastAPI/pydantic v2's 422 bodies.

Code Judge validates `Submission` / `BatchSubmission` (code_judge.md 2.2) with pydantic behind
FastAPI (which validates with `from_attributes=True`, hence `model_attributes_type` for a
non-object at any depth), so its clients see `{"detail": [{"type", "loc", "msg", "input", ("ctx")}, ...]}` on bad
input. This module reproduces those error entries for the schemas' fields, in pydantic's order
(fields in declaration order, all errors collected), without depending on pydantic. Unknown
fields are ignored, as pydantic does by default. Missing `sub_id`s are filled with uuid4s, as
Code Judge's `model_post_init` does.
"""

from __future__ import annotations

import json
from typing import Any

from sandbox_bridge.types import BatchSubmission, Submission, new_id

Loc = list[str | int]
_TYPES = ("python", "cpp", "math")


class ValidationFailed(Exception):
    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} validation error(s)")
        self.errors = errors


def parse_submission(body: bytes) -> Submission:
    errors: list[dict[str, Any]] = []
    sub = _submission(_json_body(body), ["body"], errors)
    if errors or sub is None:
        raise ValidationFailed(errors)
    return sub


def parse_batch(body: bytes) -> BatchSubmission:
    data = _json_body(body)
    errors: list[dict[str, Any]] = []
    if not isinstance(data, dict):
        raise ValidationFailed([_model_attributes(["body"], data)])
    sub_id = _opt_str(data, "sub_id", ["body"], errors)
    if "type" in data and data["type"] != "batch":
        errors.append(_literal(["body", "type"], data["type"], ("batch",)))
    subs: list[Submission] = []
    if "submissions" not in data:
        errors.append(_missing(["body", "submissions"], data))
    elif not isinstance(data["submissions"], list):
        errors.append(
            _err("list_type", ["body", "submissions"], "Input should be a valid list", data["submissions"])
        )
    else:
        items = data["submissions"]
        for i, item in enumerate(items):
            sub = _submission(item, ["body", "submissions", i], errors)
            if sub is not None:
                subs.append(sub)
        if not items:  # pydantic checks min_length after the items
            ctx = {"field_type": "List", "min_length": 1, "actual_length": 0}
            msg = "List should have at least 1 item after validation, not 0"
            errors.append(_err("too_short", ["body", "submissions"], msg, items, ctx))
    if errors:
        raise ValidationFailed(errors)
    return BatchSubmission(submissions=subs, sub_id=sub_id or new_id())


def _json_body(body: bytes) -> Any:
    try:
        data = json.loads(body) if body.strip() else None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        pos = exc.pos if isinstance(exc, json.JSONDecodeError) else exc.start
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise ValidationFailed(
            [_err("json_invalid", ["body", pos], "JSON decode error", {}, {"error": reason})]
        ) from exc
    if data is None:  # FastAPI treats an empty or `null` body as a missing one
        raise ValidationFailed([_err("missing", ["body"], "Field required", None)])
    return data


def _submission(obj: Any, loc: Loc, errors: list[dict[str, Any]]) -> Submission | None:
    if not isinstance(obj, dict):
        errors.append(_model_attributes(loc, obj))
        return None
    n = len(errors)
    sub_id = _opt_str(obj, "sub_id", loc, errors)
    if "type" not in obj:
        errors.append(_missing([*loc, "type"], obj))
    elif obj["type"] not in _TYPES or not isinstance(obj["type"], str):
        errors.append(_literal([*loc, "type"], obj["type"], _TYPES))
    options = obj.get("options")
    if options is not None:
        if not isinstance(options, dict):
            errors.append(_err("dict_type", [*loc, "options"], "Input should be a valid dictionary", options))
        else:
            for key, value in options.items():
                if not isinstance(value, str):
                    errors.append(_string_type([*loc, "options", key], value))
    if "solution" not in obj:
        errors.append(_missing([*loc, "solution"], obj))
    elif not isinstance(obj["solution"], str):
        errors.append(_string_type([*loc, "solution"], obj["solution"]))
    stdin = _opt_str(obj, "input", loc, errors)
    expected = _opt_str(obj, "expected_output", loc, errors)
    if len(errors) > n:
        return None
    return Submission(
        type=obj["type"],
        solution=obj["solution"],
        input=stdin,
        expected_output=expected,
        sub_id=sub_id or new_id(),
        options=options,
    )


def _opt_str(obj: dict[str, Any], key: str, loc: Loc, errors: list[dict[str, Any]]) -> str | None:
    value = obj.get(key)
    if value is not None and not isinstance(value, str):
        errors.append(_string_type([*loc, key], value))
        return None
    return value


def _err(kind: str, loc: Loc, msg: str, value: Any, ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {"type": kind, "loc": loc, "msg": msg, "input": value}
    if ctx is not None:
        e["ctx"] = ctx
    return e


def _missing(loc: Loc, parent: Any) -> dict[str, Any]:
    return _err("missing", loc, "Field required", parent)


def _string_type(loc: Loc, value: Any) -> dict[str, Any]:
    return _err("string_type", loc, "Input should be a valid string", value)


def _model_attributes(loc: Loc, value: Any) -> dict[str, Any]:
    msg = "Input should be a valid dictionary or object to extract fields from"
    return _err("model_attributes_type", loc, msg, value)


def _literal(loc: Loc, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    quoted = [f"'{a}'" for a in allowed]
    expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return _err("literal_error", loc, f"Input should be {expected}", value, {"expected": expected})
