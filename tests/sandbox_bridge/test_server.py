"""`streamrl sandbox serve` speaks Code Judge's HTTP API: a Code Judge-style client (plain JSON over
HTTP, as rStar2 and RLinf send it) gets Code Judge's response shapes, on both backends.

The server runs as a real process (`python -m sandbox_bridge.server`, what the CLI calls); the
redis backend also starts its own worker process and a real redis-server is used.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import psutil
import pytest

from sandbox_bridge.validation import ValidationFailed, parse_batch, parse_submission
from tests.conftest import free_port, serve_app, stop_process, wait_until

RESULT_KEYS = ["sub_id", "success", "run_success", "cost", "stdout", "stderr", "reason"]
JUDGE_KEYS = ["sub_id", "success", "run_success", "cost", "reason"]


def call(base: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def ready(base: str, workers: int) -> bool:
    try:
        return call(base, "/status")[1]["num_workers"] == workers
    except (OSError, ValueError):
        return False


@pytest.fixture(scope="module", params=["local", "redis"])
def server(request: pytest.FixtureRequest) -> Iterator[str]:
    pytest.importorskip("sandbox_bridge.local")
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "sandbox_bridge.server",
        "--port",
        str(port),
        "--workers",
        "2",
        "--timeout-s",
        "1",
    ]
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").rsplit("/", 1)[0] + "/1"  # its own database
        cmd += ["--backend", "redis", "--redis-url", url]
    proc = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: proc.poll() is not None or ready(base, 2), 60, "the server and its workers")
        assert proc.poll() is None, "the server exited at start-up"
        children = psutil.Process(proc.pid).children(recursive=True)
        yield base
    finally:
        stop_process(proc, grace_s=30)
    assert proc.returncode == 0
    wait_until(lambda: not any(c.is_running() and c.status() != "zombie" for c in children), 20, "children")


def test_ping_answers_the_json_string_pong(server: str) -> None:
    assert call(server, "/ping") == (200, "pong")


def test_status_reports_queue_length_and_workers(server: str) -> None:
    assert call(server, "/status") == (200, {"queue": 0, "num_workers": 2})


def test_run_returns_a_submission_result_with_a_generated_sub_id(server: str) -> None:
    status, got = call(server, "/run", {"type": "python", "solution": "print(input())", "input": "hi"})
    assert status == 200 and list(got) == RESULT_KEYS
    assert uuid.UUID(got["sub_id"])
    assert (got["success"], got["run_success"], got["stdout"], got["stderr"], got["reason"]) == (
        True,
        True,
        "hi\n",
        "",
        "",
    )


def test_judge_compares_stripped_stdout_and_returns_no_output_fields(server: str) -> None:
    body = {
        "sub_id": "abc",
        "type": "python",
        "solution": "print(input())",
        "input": "hi",
        "expected_output": "hi\n  ",
    }
    assert call(server, "/judge", body)[1] | {"cost": 0} == {
        "sub_id": "abc",
        "success": True,
        "run_success": True,
        "cost": 0,
        "reason": "",
    }
    wrong = call(server, "/judge", body | {"expected_output": "bye"})[1]
    assert (wrong["success"], wrong["run_success"]) == (False, True)


def test_missing_stdin_is_end_of_file(server: str) -> None:
    got = call(server, "/run", {"type": "python", "solution": "input()"})[1]
    assert got["run_success"] is False and "EOFError" in got["stderr"]


def test_a_job_over_the_time_limit_is_a_worker_timeout(server: str) -> None:
    got = call(server, "/run", {"type": "python", "solution": "import time\ntime.sleep(10)"})[1]
    assert (got["success"], got["run_success"], got["reason"]) == (False, False, "worker_timeout")
    assert got["cost"] >= 1.0


def test_math_submissions_validate_but_come_back_as_internal_error(server: str) -> None:
    got = call(server, "/run", {"type": "math", "solution": "1+1"})[1]
    assert (got["run_success"], got["stdout"], got["stderr"], got["reason"]) == (
        False,
        None,
        None,
        "internal_error",
    )


@pytest.mark.parametrize("path", ["/run/batch", "/run/long-batch", "/judge/batch", "/judge/long-batch"])
def test_batches_answer_in_request_order_under_the_batch_sub_id(server: str, path: str) -> None:
    subs = [
        {"sub_id": "echo", "type": "python", "solution": "print(input())", "input": "a"},
        {"type": "python", "solution": "x = 1\n1/0"},
        {"sub_id": "exit3", "type": "python", "solution": "import sys\nsys.exit(3)"},
        {"sub_id": "wrong", "type": "python", "solution": "print(1)", "expected_output": "2"},
    ]
    status, got = call(server, path, {"sub_id": "B1", "type": "batch", "submissions": subs})
    assert status == 200 and list(got) == ["sub_id", "results"] and got["sub_id"] == "B1"
    results = got["results"]
    keys = JUDGE_KEYS if path.startswith("/judge") else RESULT_KEYS
    assert all(list(r) == keys for r in results)
    assert [r["sub_id"] for r in results[::2]] == ["echo", "exit3"] and uuid.UUID(results[1]["sub_id"])
    assert [(r["success"], r["run_success"], r["reason"]) for r in results] == [
        (True, True, ""),
        (False, False, ""),
        (False, False, ""),
        (False, True, ""),
    ]
    if keys == RESULT_KEYS:
        assert results[0]["stdout"] == "a\n" and "ZeroDivisionError" in results[1]["stderr"]


@pytest.mark.parametrize(
    ("path", "body", "detail"),
    [
        (
            "/run",
            {"type": "ruby", "solution": "x"},
            [
                {
                    "type": "literal_error",
                    "loc": ["body", "type"],
                    "msg": "Input should be 'python', 'cpp' or 'math'",
                    "input": "ruby",
                    "ctx": {"expected": "'python', 'cpp' or 'math'"},
                }
            ],
        ),
        (
            "/judge",
            {"type": "python"},
            [
                {
                    "type": "missing",
                    "loc": ["body", "solution"],
                    "msg": "Field required",
                    "input": {"type": "python"},
                }
            ],
        ),
        (
            "/run/long-batch",
            {"type": "batch", "submissions": []},
            [
                {
                    "type": "too_short",
                    "loc": ["body", "submissions"],
                    "msg": "List should have at least 1 item after validation, not 0",
                    "input": [],
                    "ctx": {"field_type": "List", "min_length": 1, "actual_length": 0},
                }
            ],
        ),
    ],
)
def test_invalid_requests_get_fastapis_422_body(server: str, path: str, body: Any, detail: Any) -> None:
    assert call(server, path, body) == (422, {"detail": detail})


def test_a_body_that_is_not_json_is_a_422_json_invalid(server: str) -> None:
    status, got = call(server, "/run", raw=b'{"type": "python",')
    assert status == 422
    assert got["detail"][0]["type"] == "json_invalid" and got["detail"][0]["loc"][0] == "body"


BAD_SUBMISSIONS = [
    {"type": "ruby", "solution": "x"},
    {"type": "python"},
    {},
    {"type": ["python"], "solution": 3, "input": 5, "expected_output": [], "sub_id": 7},
    {"type": "python", "solution": "x", "options": {"a": 1, "b": "c"}},
    {"type": "python", "solution": "x", "options": "nope"},
    [],
    "text",
    None,
]
BAD_BATCHES = [
    {"type": "batch", "submissions": []},
    {"submissions": "x"},
    {"type": "single", "submissions": [{"type": "python", "solution": "1"}]},
    {"sub_id": 1},
    {"submissions": [{"type": "cpp"}, 5, {"type": "python", "solution": "1"}, {"type": "go", "solution": 2}]},
    [],
]


@pytest.mark.parametrize("body", BAD_SUBMISSIONS)
def test_submission_errors_match_pydantic_error_for_error(body: Any) -> None:
    from tests.sandbox_bridge.cj_models import CJSubmission, fastapi_422

    with pytest.raises(ValidationFailed) as info:
        parse_submission(json.dumps(body).encode())
    assert info.value.errors == fastapi_422(CJSubmission, body)


@pytest.mark.parametrize("body", BAD_BATCHES)
def test_batch_errors_match_pydantic_error_for_error(body: Any) -> None:
    from tests.sandbox_bridge.cj_models import CJBatchSubmission, fastapi_422

    with pytest.raises(ValidationFailed) as info:
        parse_batch(json.dumps(body).encode())
    assert info.value.errors == fastapi_422(CJBatchSubmission, body)


def test_valid_requests_get_uuid_sub_ids_and_keep_given_ones() -> None:
    batch = parse_batch(
        b'{"submissions": [{"type": "cpp", "solution": "int main(){}"}, {"sub_id": "k", "type": "python", "solution": ""}]}'
    )
    assert uuid.UUID(batch.sub_id or "") and uuid.UUID(batch.submissions[0].sub_id or "")
    assert batch.submissions[1].sub_id == "k"
    assert parse_submission(b'{"type": "python", "solution": "1", "extra": true}').solution == "1"


def test_jobs_not_done_within_the_wait_budget_come_back_as_queue_timeout() -> None:
    pytest.importorskip("sandbox_bridge.local")
    from sandbox_bridge.server import LocalBackend, make_app

    async def go() -> tuple[dict[str, Any], float]:
        backend = LocalBackend(max_workers=1, timeout_s=5.0, memory_mb=256, preload=())
        app = make_app(backend, timeout_s=5.0, short_wait_s=0.5)
        body = {"submissions": [{"type": "python", "solution": "import time\ntime.sleep(2)"}] * 2}
        async with serve_app(app) as url, aiohttp.ClientSession() as http:
            t0 = time.monotonic()
            async with http.post(
                f"{url}/run/batch", json=body, timeout=aiohttp.ClientTimeout(total=30)
            ) as resp:
                return await resp.json(), time.monotonic() - t0

    got, elapsed = asyncio.run(go())
    assert [r["reason"] for r in got["results"]] == ["queue_timeout", "queue_timeout"]
    assert all(r["stdout"] is None and r["cost"] >= 0.5 for r in got["results"])
    assert elapsed < 2.0
