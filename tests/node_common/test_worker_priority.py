"""A worker sets its own scheduling priority whatever level the process started at (``set_priority``): Ray starts
worker processes at nice 15, below the front-end; a decode worker goes back to 0 and a prefill worker sharing cores to
its ``nice``. Where raising priority is not permitted the order still holds: the decode worker keeps its level and a
lower-priority worker goes to the lowest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from node_common import worker_actor
from node_common.worker_actor import LOWEST_NICE, set_priority

CHILD = textwrap.dedent("""
    import json, os, threading, time
    from node_common.worker_actor import set_priority
    os.nice(15)  # as Ray's worker_niceness leaves a worker process
    stop = threading.Event()
    t = threading.Thread(target=stop.wait); t.start()  # a thread that exists before the call

    def levels():
        return sorted({os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")})

    out = {"first": set_priority(0)}
    out["after_first"] = levels()
    late = {}
    t2 = threading.Thread(target=lambda: late.update(n=os.getpriority(os.PRIO_PROCESS, 0))); t2.start(); t2.join()
    out["late"] = late["n"]
    out["second"] = set_priority(10)
    out["after_second"] = levels()
    stop.set(); t.join()
    print(json.dumps(out))
""")


@pytest.mark.skipif(not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"), reason="Linux only")
def test_a_worker_started_at_nice_15_sets_every_thread_to_its_own_level():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    if seen["first"] == 0:  # permitted (CAP_SYS_NICE or RLIMIT_NICE): the levels asked for
        assert seen["after_first"] == [0] and seen["late"] == 0
        assert seen["second"] == 10 and seen["after_second"] == [10]
    else:  # not permitted: decode keeps Ray's level, a worker meant to run below it goes lower still
        assert seen["first"] == 15 and seen["after_first"] == [15] and seen["late"] == 15
        assert seen["second"] == LOWEST_NICE and seen["after_second"] == [LOWEST_NICE]


def test_without_permission_a_lower_priority_worker_still_runs_below(monkeypatch):
    levels = {0: 15, 1: 15}  # thread id -> nice; 0 is "this thread"

    def setpriority(which, who, value):
        if value < levels[who]:
            raise PermissionError("not permitted")
        levels[who] = value

    monkeypatch.setattr(worker_actor.os, "getpriority", lambda which, who: levels[who])
    monkeypatch.setattr(worker_actor.os, "setpriority", setpriority)
    monkeypatch.setattr(worker_actor, "_threads", lambda: [0, 1])
    assert set_priority(0) == 15 and levels == {0: 15, 1: 15}  # nothing changed
    assert set_priority(10) == LOWEST_NICE and levels == {0: LOWEST_NICE, 1: LOWEST_NICE}
