"""One serving process: the gRPC ``duet.v1`` service and the OpenAI-compatible HTTP API over one
:class:`~cluster.control.disagg.DisaggCluster`, on one event loop.

:class:`Server` runs on the caller's loop (``duet serve`` uses the main thread's); :class:`ServerThread` runs one on a
background thread (tests, notebooks). Several servers may share one cluster (each with its own limits and token).
Shutdown drains: health turns NOT_SERVING, new requests get UNAVAILABLE / 503, in-flight ones run to the end (up to
``drain_timeout_s``, then they are aborted), then both listeners close. The cluster is the caller's to shut down.

Between start and stop a server also runs two daemon threads: the metrics sampler (cluster status and expert summary
for ``/metrics``, every ``METRICS_REFRESH_S``) and, when ``serve.autoscaling_policy`` is set, the autoscaling loop
(:mod:`cluster.serve.autoscaling`), which stops before the drain begins; workers it added stay in the cluster.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ssl
import threading
from pathlib import Path
from typing import Any

from aiohttp import web
from grpc_health.v1 import health_pb2

from cluster.control.autoscale import load_policy
from cluster.serve.autoscaling import AutoscaleLoop
from cluster.serve.config import ServeConfig
from cluster.serve.grpc_api import start_grpc
from cluster.serve.openai_api import make_app
from cluster.serve.service import InferenceService
from engine.errors import DuetError


class BindError(DuetError):
    """A listener could not bind its address."""


def default_model_name(model_dir: str | Path) -> str:
    from cluster.demo import DEMO_MODEL_DIR

    path = Path(model_dir).resolve()
    return "duet-demo" if path == DEMO_MODEL_DIR.resolve() else path.name


class Server:
    METRICS_REFRESH_S = 5.0

    def __init__(self, cluster: Any, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.cluster = cluster
        name = cfg.model_name or default_model_name(cluster.spec.model_dir)
        self.service = InferenceService(cluster, cfg.limits, name)
        self.sampler = self.service.metrics.attach_cluster(cluster, self.METRICS_REFRESH_S)
        self.autoscale: AutoscaleLoop | None = None
        if cfg.autoscaling_policy is not None:
            self.autoscale = self._autoscale_loop(cluster, load_policy(cfg.autoscaling_policy))
        self.grpc_port: int | None = None
        self.http_port: int | None = None
        self._grpc = self._health = self._runner = None

    @property
    def grpc_target(self) -> str:
        return f"{self.cfg.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{'https' if self.cfg.tls else 'http'}://{self.cfg.host}:{self.http_port}"

    async def start(self) -> None:
        """Bind and start both listeners (port 0 picks a free port; the bound ones are in ``grpc_port`` and
        ``http_port``)."""
        try:
            self._grpc, self.grpc_port, self._health = await start_grpc(self.service, self.cfg)
        except RuntimeError as e:
            raise BindError(f"gRPC cannot listen on {self.cfg.host}:{self.cfg.grpc_port}: {e}") from None
        app = make_app(self.service, self.cfg.token, self.cfg.limits.max_message_bytes)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.http_port, ssl_context=self._ssl_context())
        try:
            await site.start()
        except OSError as e:
            await self._grpc.stop(None)
            await self._runner.cleanup()
            raise BindError(f"HTTP cannot listen on {self.cfg.host}:{self.cfg.http_port}: {e.strerror}") from None
        self.http_port = self._runner.addresses[0][1]
        self.sampler.start()
        if self.autoscale is not None:
            self.autoscale.start()

    async def mark_unavailable(self, reason: str | None) -> None:
        """Refuse new requests with ``reason`` (ClusterUnavailableError: gRPC UNAVAILABLE / HTTP 503), health checks
        failing, or (``None``) serve again (:mod:`cluster.serve.head_watch`)."""
        self.service.unavailable = reason
        self.service.metrics.available.set(reason is None)
        if self._health is not None and not self.service.draining:
            status = health_pb2.HealthCheckResponse.SERVING if reason is None else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", "duet.v1.Duet"):
                await self._health.set(name, status)

    async def swap_cluster(self, cluster: Any) -> None:
        """Serve on ``cluster`` from now on (a new one after the Ray head came back empty:
        :mod:`cluster.serve.head_watch`); the old one was abandoned by whoever built this one. Same spec, same model:
        the service's limits stay; metrics and autoscaling follow the new cluster."""
        loop = asyncio.get_running_loop()
        self.cluster = self.service.cluster = cluster
        self.service.metrics.swap_cluster(cluster)
        if self.autoscale is not None:
            policy = self.autoscale.autoscaler.policy
            await loop.run_in_executor(None, self.autoscale.stop)
            self.autoscale = self._autoscale_loop(cluster, policy)
            self.autoscale.start()

    def _autoscale_loop(self, cluster: Any, policy: Any) -> AutoscaleLoop:
        return AutoscaleLoop(cluster, policy, self.service.metrics, lambda: self.service.admission.in_flight)

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self.cfg.tls:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(self.cfg.tls_cert, self.cfg.tls_key)
        return ctx

    def ready_line(self) -> str:
        spec, share = self.cluster.spec, self.cluster.pool.share
        threads, local = share.prefill, share.local_prefill
        shared = (f" (nice {threads['nice']}: decode first"
                  f"{', fewer while decode steps' if threads.get('adaptive_threads') else ''})") if threads["nice"] else ""
        if local:  # why: on shared cores a short prompt's hand-off costs more than its prefill step
            shared += f"  text prompts <= {local} tokens prefilled on the decode worker (shared cores)"
        return (f"duet serve: ready  grpc={self.grpc_target}  http={self.http_url}  model={self.service.model_name}  "
                f"workers={spec.num_prefill} prefill + {spec.num_decode} decode ({spec.transport})  "
                f"prefill_threads={threads['num_threads']}{shared}"
                f"{'  tls' if self.cfg.tls else ''}{'  auth=token' if self.cfg.token else ''}")

    async def stop(self, drain_timeout_s: float | None = None, force: asyncio.Event | None = None) -> None:
        """Drain, then close both listeners (idempotent)."""
        if self._grpc is None:
            return
        loop = asyncio.get_running_loop()
        if self.autoscale is not None:  # no pool changes while draining
            await loop.run_in_executor(None, self.autoscale.stop)
        await loop.run_in_executor(None, self.sampler.stop)
        await self._health.enter_graceful_shutdown()
        await self.service.drain(self.cfg.drain_timeout_s if drain_timeout_s is None else drain_timeout_s, force)
        await self._grpc.stop(grace=1.0)
        await self._runner.cleanup()
        self.service.close()
        self._grpc = None


class ServerThread:
    """A :class:`Server` on its own event loop thread: ``start()`` returns once it takes requests."""

    def __init__(self, cluster: Any, cfg: ServeConfig) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="duet-serve", daemon=True)
        self._thread.start()
        self.server = self._call(self._make(cluster, cfg))

    async def _make(self, cluster: Any, cfg: ServeConfig) -> Server:
        return Server(cluster, cfg)

    def _call(self, coro, timeout: float | None = 60.0):
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError("the server thread did not answer in time") from None

    def start(self) -> Server:
        self._call(self.server.start())
        return self.server

    def stop(self, drain_timeout_s: float = 5.0) -> None:
        self._call(self.server.stop(drain_timeout_s), timeout=drain_timeout_s + 30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
