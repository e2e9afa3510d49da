"""Code Judge conformance of the embedded executor (code_judge.md 7.2 and 7.4), through real workers.

One warm pool serves the whole module; every case is a real fork of a real worker. The timeout is
short (1.5 s) so the timeout cases stay cheap.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from sandbox_bridge import LocalSandbox
from sandbox_bridge.local import leftovers
from sandbox_bridge.types import Submission, SubmissionResult

TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def sb() -> Iterator[LocalSandbox]:
    box = LocalSandbox(max_workers=2, timeout_s=TIMEOUT_S, memory_mb=256)
    try:
        yield box
    finally:
        box.close()
    assert leftovers(box.spawned_pids()) == []


def py(
    sb: LocalSandbox, code: str, stdin: str | None = None, expected: str | None = None
) -> SubmissionResult:
    return sb.submit_sync(Submission(type="python", solution=code, input=stdin, expected_output=expected))


def test_echo_through_stdin_succeeds(sb: LocalSandbox) -> None:
    r = py(sb, "print(input())", "hi")
    assert (r.success, r.run_success, r.stdout, r.stderr, r.reason) == (True, True, "hi\n", "", "")
    assert 0 < r.cost < TIMEOUT_S
    assert r.isolation == sb.isolation != ""


def test_wrong_answer_runs_but_does_not_succeed(sb: LocalSandbox) -> None:
    r = py(sb, "print(1 + 1)", expected="3")
    assert r.run_success and not r.success and r.reason == ""


def test_expected_output_is_compared_after_stripping_the_whole_stdout(sb: LocalSandbox) -> None:
    assert py(sb, "print(input())", "hi", expected="hi\n  ").success
    assert py(sb, "print('  hi  ')", expected="hi").success
    assert not py(sb, "print('h i')", expected="hi").success
    assert not py(sb, "print('a\\n b')", expected="a\nb").success  # no per-line normalisation


@pytest.mark.parametrize("stdin", [None, ""])
def test_missing_input_is_eof_so_input_fails(sb: LocalSandbox, stdin: str | None) -> None:
    r = py(sb, "print(input())", stdin)
    assert not r.run_success and r.reason == ""
    assert "EOFError" in (r.stderr or "")


def test_sleep_past_the_timeout_is_a_worker_timeout_with_code_judges_stdout(sb: LocalSandbox) -> None:
    t0 = time.monotonic()
    r = py(sb, "import time\ntime.sleep(10)")
    assert time.monotonic() - t0 < TIMEOUT_S + 4  # (slack for a heavily loaded 2-core machine)
    assert (r.success, r.run_success, r.reason) == (False, False, "worker_timeout")
    assert (r.stdout or "").strip() == "Suicide from timeout."
    assert TIMEOUT_S <= r.cost < TIMEOUT_S + 2


def test_a_nonzero_exit_is_a_plain_failure(sb: LocalSandbox) -> None:
    r = py(sb, "import sys\nsys.exit(3)")
    assert (r.run_success, r.reason) == (False, "")


def test_sys_exit_with_a_message_prints_it_to_stderr(sb: LocalSandbox) -> None:
    r = py(sb, "import sys\nsys.exit('bye')")
    assert not r.run_success and r.stderr == "bye\n"


def test_signals_a_job_sends_itself_still_end_it(sb: LocalSandbox) -> None:
    r = py(sb, "import signal, time\nsignal.alarm(1)\ntime.sleep(5)\nprint('survived')")
    assert (r.run_success, r.stdout, r.reason) == (False, "", "")  # alarm() without a handler
    r = py(sb, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('survived')")
    assert (r.run_success, r.stdout) == (False, "")


def test_a_traceback_names_the_users_own_line(sb: LocalSandbox) -> None:
    r = py(sb, "x = 1\n1/0")
    assert not r.run_success and r.reason == ""
    assert 'source.py", line 2, in <module>' in (r.stderr or "")
    assert "ZeroDivisionError: division by zero" in (r.stderr or "")
    assert "sandbox_bridge" not in (r.stderr or "")  # the runner's own frames are not shown


def test_a_syntax_error_is_reported_in_stderr(sb: LocalSandbox) -> None:
    r = py(sb, "def f(:\n  pass")
    assert not r.run_success and "SyntaxError" in (r.stderr or "")


def test_output_is_cut_to_the_head_but_compared_in_full(sb: LocalSandbox) -> None:
    r = py(sb, "print('a' * 5000)\nimport sys\nsys.stderr.write('e' * 3000)", expected="a" * 5000)
    assert r.success
    assert r.stdout == "a" * 1000 and r.stderr == "e" * 1000


def test_a_large_input_is_read_in_full(sb: LocalSandbox) -> None:
    data = "x" * 1_000_000
    r = py(sb, "import sys\nprint(len(sys.stdin.read()))", data)
    assert r.stdout == "1000000\n"


def test_a_multiprocessing_child_outliving_its_parent_is_killed(sb: LocalSandbox) -> None:
    code = (
        "import multiprocessing, time\n"
        "def f():\n    time.sleep(30)\n"
        "if __name__ == '__main__':\n"
        "    multiprocessing.Process(target=f).start()\n    print('parent exits')\n"
    )
    r = py(sb, code)
    assert not r.run_success and r.reason == "worker_timeout"


def test_multiprocessing_pool_works(sb: LocalSandbox) -> None:
    code = (
        "from multiprocessing import Pool\n"
        "def sq(x):\n    return x * x\n"
        "if __name__ == '__main__':\n    with Pool(2) as p:\n        print(p.map(sq, range(5)))\n"
    )
    assert py(sb, code).stdout == "[0, 1, 4, 9, 16]\n"


def test_non_daemon_threads_are_joined_before_the_job_ends(sb: LocalSandbox) -> None:
    code = "import threading, time\nthreading.Thread(target=lambda: (time.sleep(0.1), print('late'))).start()"
    assert py(sb, code).stdout == "late\n"


def test_a_file_written_in_the_working_directory_can_be_read_back(sb: LocalSandbox) -> None:
    r = py(sb, "open('x.txt', 'w').write('hello')\nprint(open('x.txt').read())")
    assert r.success and r.stdout == "hello\n"


def test_a_write_to_the_parent_directory_is_denied(sb: LocalSandbox) -> None:
    if not {"setuid", "mntns-ro"} & set(sb.isolation.split("+")):
        pytest.skip(f"jobs run as the worker's own user here ({sb.isolation}): nothing to deny")
    r = py(sb, "open('../test.txt', 'w').write('jailbreak')")
    assert not r.run_success and "PermissionError" in (r.stderr or "")


def test_each_job_gets_a_fresh_working_directory(sb: LocalSandbox) -> None:
    py(sb, "open('left_behind.txt', 'w').write('x')")
    r = py(sb, "import os\nprint(sorted(os.listdir('.')))")
    assert r.stdout == "['source.py']\n"


def test_math_type_is_an_internal_error_as_in_code_judge(sb: LocalSandbox) -> None:
    r = sb.submit_sync(Submission(type="math", solution="1+1", sub_id="m1"))
    assert (r.sub_id, r.reason, r.cost, r.stdout, r.stderr) == ("m1", "internal_error", 0.0, None, None)


def test_sub_id_is_echoed_or_generated(sb: LocalSandbox) -> None:
    assert sb.submit_sync(Submission(type="python", solution="pass", sub_id="abc")).sub_id == "abc"
    assert len(sb.run_sync("pass").sub_id) == 36


def test_preloaded_sympy_imports_without_cost(sb: LocalSandbox) -> None:
    r = py(sb, "import sympy\nprint(sympy.factor('x**2 - 1'))")
    assert r.stdout == "(x - 1)*(x + 1)\n"
    assert r.cost < 0.4  # a cold `import sympy` alone takes ~0.5 s (more on a loaded machine)


def test_numpy_random_state_differs_between_jobs(sb: LocalSandbox) -> None:
    draws = {py(sb, "import numpy as np\nprint(np.random.rand())").stdout for _ in range(3)}
    assert len(draws) == 3


def test_the_result_encodes_as_code_judges_submission_result(sb: LocalSandbox) -> None:
    d = py(sb, "print(1)").to_codejudge()
    assert list(d) == ["sub_id", "success", "run_success", "cost", "stdout", "stderr", "reason"]


def cpp(
    sb: LocalSandbox, code: str, stdin: str | None = None, expected: str | None = None
) -> SubmissionResult:
    if not sb.cpp_available:
        pytest.skip("g++ not found: C++ submissions are internal_error on this host")
    return sb.submit_sync(Submission(type="cpp", solution=code, input=stdin, expected_output=expected))


def test_cpp_compile_error_is_a_plain_failure_with_the_compiler_message(sb: LocalSandbox) -> None:
    r = cpp(sb, "int main(){ return x; }")
    assert (r.run_success, r.reason, r.cost, r.stdout) == (False, "", 0.0, "")
    assert "error" in (r.stderr or "") and "'x'" in (r.stderr or "").replace("‘", "'").replace("’", "'")


def test_cpp_reads_stdin_and_is_judged(sb: LocalSandbox) -> None:
    r = cpp(sb, '#include <cstdio>\nint main(){int a; scanf("%d",&a); printf("%d\\n", a*2);}', "21", "42")
    assert r.success and r.stdout == "42\n"


def test_cpp_sleep_is_a_worker_timeout(sb: LocalSandbox) -> None:
    r = cpp(sb, "#include <unistd.h>\nint main(){ sleep(10); }")
    assert r.reason == "worker_timeout" and (r.stdout or "").strip() == "Suicide from timeout."
