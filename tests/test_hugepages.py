"""The entry points' re-execution with malloc huge pages (train/hugepages.py)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from train import hugepages

LINUX = ("Linux", ("glibc", "2.35"), "madvise")


@pytest.mark.parametrize("system, libc, mode, environ, expected", [
    (*LINUX, {}, "glibc.malloc.hugetlb=1"),
    ("Linux", ("glibc", "2.39"), "always", {}, "glibc.malloc.hugetlb=1"),
    (*LINUX, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"},
     "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
    (*LINUX, {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, None),  # the user's choice stands
    ("Linux", ("glibc", "2.34"), "madvise", {}, None),  # no such tunable before 2.35
    ("Linux", ("glibc", "2.35"), "never", {}, None),
    ("Linux", ("glibc", "2.35"), "", {}, None),  # the mode file is absent
    ("Linux", ("", ""), "madvise", {}, None),  # musl
    ("Darwin", ("", ""), "", {}, None),
])
def test_the_tunable_is_added_only_where_it_applies(system, libc, mode, environ, expected):
    tuned = hugepages.tuned_environment({"PATH": "/bin", **environ}, system, libc, mode)
    if expected is None:
        assert tuned is None
    else:
        assert tuned == {"PATH": "/bin", "GLIBC_TUNABLES": expected}


PRINT_TUNABLES = ("from train import hugepages; hugepages.reexec(); import os; "
                  "print(os.environ.get('GLIBC_TUNABLES'), os.getpid())")


def run(environ: dict[str, str]) -> str:
    """The child's GLIBC_TUNABLES, checking that it ran under the pid it was started with."""
    child = subprocess.Popen([sys.executable, "-c", PRINT_TUNABLES], env=environ, text=True,
                             stdout=subprocess.PIPE)
    output, _ = child.communicate()
    assert child.returncode == 0
    tunables, pid = output.split()
    assert int(pid) == child.pid
    return tunables


def test_a_process_reexecutes_itself_once_with_the_tunable_and_keeps_its_pid():
    environ = {key: value for key, value in os.environ.items() if key != "GLIBC_TUNABLES"}
    if hugepages.tuned_environment(environ, platform.system(), platform.libc_ver(),
                                   hugepages.thp_mode()) is None:
        pytest.skip("huge pages for malloc do not apply on this machine")
    assert run(environ) == "glibc.malloc.hugetlb=1"
    assert run({**environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == "glibc.malloc.hugetlb=0"
