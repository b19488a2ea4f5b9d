"""A worker actor computes on one thread with its ``num_threads`` OpenMP threads; every other thread of the process
runs one (``WorkerActorBase._build``). Run in a child process with OMP_NUM_THREADS=1 as Ray sets it for an actor, so
the per-thread OpenMP settings start where a worker's do and this test process keeps its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import json, threading, torch
    from node_common.worker_actor import WorkerActorBase

    class Actor(WorkerActorBase):
        role = "probe"

        def __init__(self, fail=False):
            self._init_common("w0", num_threads=2)
            self.seen = {}

            def build():
                if fail:
                    raise ValueError("no model here")
                self.seen["build_thread"] = threading.current_thread().name
                self.seen["build_threads"] = torch.get_num_threads()
                return object()

            self._build(build)
            self._start()

        def _loop(self):
            self.seen["loop_thread"] = threading.current_thread().name
            self.seen["loop_threads"] = torch.get_num_threads()

    a = Actor()
    a.thread.join(10)
    caller = torch.get_num_threads()
    other = {}
    t = threading.Thread(target=lambda: other.update(n=torch.get_num_threads())); t.start(); t.join()
    try:
        Actor(fail=True)
        error = None
    except ValueError as e:
        error = str(e)
    print(json.dumps({**a.seen, "caller_threads": caller, "other_threads": other["n"],
                      "error": error}))
""")


def test_build_and_loop_share_one_thread_with_the_workers_thread_count():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["build_thread"] == seen["loop_thread"] == "probe-w0"  # the engine is loaded where it steps
    assert seen["build_threads"] == seen["loop_threads"] == 2
    assert seen["caller_threads"] == 1 and seen["other_threads"] == 1  # no second OpenMP team in the process
    assert seen["error"] == "no model here"  # a failed build raises in the constructor
