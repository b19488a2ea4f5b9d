"""The front-end's watch on its Ray head (:mod:`cluster.serve.head_watch`): a lost head makes the server refuse new
requests at once (gRPC UNAVAILABLE / HTTP 503 with a retry hint, health checks failing), a head that comes back as
the same cluster is served again, one that comes back empty gets fresh workers, and a failed rebuild is retried.

The state machine runs against a scripted probe and a fake server (no Ray); the refusal runs on a real front-end
over the shared demo cluster. The whole path -- ``duet serve --address`` against a Ray head that is SIGKILLed and
started again -- is the chaos soak's ``kill_head`` fault (tests/duet_bench/test_chaos.py)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from cluster.serve import ServeConfig, ServerThread
from cluster.serve.head_watch import LOST, REPLACED, UP, HeadWatch
from duet_client import Client, Unavailable
from tests.cluster.serve.conftest import SHAPES_ANSWER


class _Service:
    def __init__(self) -> None:
        from cluster.serve.metrics import Metrics

        self.unavailable: str | None = None
        self.cluster = "old"
        self.metrics = Metrics(lambda: iter(()), lambda: 0)

    def events(self, event: str) -> float:
        return self.metrics.registry.get_sample_value("duet_ray_head_events_total", {"event": event}) or 0.0


class _Server:
    """What HeadWatch touches: ``mark_unavailable`` (recorded) and ``swap_cluster``."""

    def __init__(self) -> None:
        self.service = _Service()
        self.marks: list[str | None] = []
        self.swapped: list[object] = []

    async def mark_unavailable(self, reason: str | None) -> None:
        self.service.unavailable = reason
        self.marks.append(reason)

    async def swap_cluster(self, cluster: object) -> None:
        self.service.cluster = cluster
        self.swapped.append(cluster)


def _run(answers: list[str], rebuild, **kw) -> tuple[HeadWatch, _Server, list[str | None]]:
    """Run a watch over the scripted ``answers`` (then UP forever) until they are used up; returns it, its server
    and what the service's ``unavailable`` was after each probe."""
    server, seen = _Server(), []
    script = list(answers)

    def probe(timeout_s: float) -> str:
        seen.append(server.service.unavailable)
        return script.pop(0) if script else UP

    async def main() -> HeadWatch:
        watch = HeadWatch(server, rebuild, check_s=0.0, retry_s=0.0, probe=probe, **kw)
        watch.start()
        while script or len(seen) <= len(answers) + 1:
            await asyncio.sleep(0.001)
        await watch.stop()
        return watch

    return asyncio.run(main()), server, seen


def test_a_lost_head_refuses_until_the_same_cluster_answers_again():
    def rebuild():
        raise AssertionError("the same cluster came back: nothing to rebuild")

    watch, server, seen = _run([UP, LOST, LOST, UP, UP], rebuild)
    assert seen[0] is None and seen[1] is None  # served until the first lost answer
    assert "does not answer" in seen[2] and "retry" in seen[2] and "does not answer" in seen[3]
    assert seen[4] is None and server.service.unavailable is None
    assert watch.losses == 1 and watch.rebuilds == 0 and watch.state == UP and watch.lost_at is None
    assert server.service.events("lost") == 1 and server.service.events("rebuilt") == 0
    assert server.marks[-1] is None and server.service.cluster == "old"


def test_a_head_that_restarted_empty_gets_new_workers_and_a_failed_start_is_retried():
    calls = []

    def rebuild():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("GCS not ready yet")
        return "new"

    watch, server, seen = _run([LOST, REPLACED, UP], rebuild)  # the failed rebuild is retried though the head is up
    assert watch.failed_rebuilds == 1 and watch.rebuilds == 1 and len(calls) == 2
    assert server.swapped == ["new"] and server.service.cluster == "new"
    assert any(m and "new workers are starting" in m for m in server.marks)
    assert server.service.unavailable is None and watch.state == UP and watch.losses == 1
    assert [server.service.events(e) for e in ("lost", "rebuild_failed", "rebuilt")] == [1, 1, 1]


def test_an_embedded_head_lost_too_long_is_restarted_by_the_rebuild():
    built = []
    watch, server, _ = _run([LOST] * 4, lambda: built.append("new") or "new", restart_after_s=0.0)
    assert built and server.swapped[0] == "new" and watch.rebuilds >= 1 and server.service.unavailable is None


def test_without_restart_after_a_lost_head_is_only_waited_for():
    watch, server, seen = _run([LOST] * 5, lambda: pytest.fail("rebuilt an address the watch cannot restart"))
    assert watch.rebuilds == 0 and all("does not answer" in s for s in seen[1:5])


@pytest.fixture(scope="module")
def server(serve_cluster):
    t = ServerThread(serve_cluster, ServeConfig(grpc_port=0, http_port=0, drain_timeout_s=5))
    srv = t.start()
    yield srv, t
    t.stop()


def test_an_unavailable_cluster_is_refused_at_once_and_served_again(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    srv, thread = server
    why = "the cluster is unavailable: its Ray head does not answer (for 3 s); retry shortly"
    thread._call(srv.mark_unavailable(why))
    try:
        with Client(srv.grpc_target) as c:
            with pytest.raises(Unavailable, match="Ray head does not answer") as e:
                c.generate_text("red")
            assert e.value.retry_after_s == pytest.approx(2.0)
            with pytest.raises(Unavailable, match="Ray head"):
                c.cluster_status(timeout=10)
        r = httpx.post(f"{srv.http_url}/v1/completions", json={"prompt": "red", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) == 2
        assert r.json()["error"]["code"] == "cluster_unavailable" and "Ray head" in r.json()["error"]["message"]
        assert "duet_cluster_available 0.0" in httpx.get(f"{srv.http_url}/metrics", timeout=10).text
        h = httpx.get(f"{srv.http_url}/health", timeout=10)
        assert h.status_code == 503 and h.json() == {"status": "unavailable"}
        with grpc.insecure_channel(srv.grpc_target) as ch:
            got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="duet.v1.Duet"), timeout=10)
            assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        thread._call(srv.mark_unavailable(None))
    with Client(srv.grpc_target) as c:
        assert c.generate_text("<image>Describe the image.", images=[_shapes()]).text == SHAPES_ANSWER
        assert c.cluster_status(timeout=10)["workers"]
    assert httpx.get(f"{srv.http_url}/health", timeout=10).json() == {"status": "ok"}
    assert "duet_cluster_available 1.0" in httpx.get(f"{srv.http_url}/metrics", timeout=10).text


def _shapes():
    from pathlib import Path

    return Path(__file__).resolve().parents[3] / "examples" / "shapes.png"


def test_a_cluster_stopped_under_a_running_request_ends_it_typed_not_hung():
    """A rebuild abandons the old cluster, whose loop cancels every task: a request streaming from it gets a
    retryable ClusterUnavailableError (it used to wait on its hand-over queue for ever)."""
    import threading

    from cluster.control.disagg import DisaggCluster
    from cluster.control.errors import ClusterUnavailableError

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cluster = DisaggCluster.__new__(DisaggCluster)  # only what stream() uses: the loop and _serve
    cluster._loop = loop
    started = threading.Event()

    async def serve(*args):
        started.set()
        await asyncio.sleep(3600)
        yield None

    cluster._serve = serve

    async def consume():
        async for _ in cluster.stream(("p", {})):
            pass

    async def main():
        task = asyncio.ensure_future(consume())
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)

        async def cancel_all():
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.cancel()

        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(5)
        with pytest.raises(ClusterUnavailableError, match="stopped"):
            await asyncio.wait_for(task, 10)

    try:
        asyncio.run(main())
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
