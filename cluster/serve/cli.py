"""``duet serve``: start (or join) a Ray cluster, build the prefill/decode deployment, serve gRPC and HTTP.

Prints exactly one line on stdout when it takes requests (``duet serve: ready  grpc=HOST:PORT  http=URL ...``);
everything else goes to stderr, among it, just before, how long the start took and where (``duet serve: started in
6.31 s (Ray 3.61 s, workers 2.69 s, front-end 0.01 s)``: Ray's start or connection with this process's imports and
config checks, the workers' start with their model loads, the servers'). Ctrl-C or SIGTERM drains in-flight
requests (up to ``drain_timeout_s``; a second signal aborts them at once) and shuts the workers down.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
import time

logger = logging.getLogger("duet.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML or JSON file: ClusterSpec fields and a 'serve:' section")
    p.add_argument("--model-dir", help="checkpoint directory (default: the config's, else the embedded demo model)")
    p.add_argument("--host", help="address both servers bind (default 127.0.0.1)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default 50051; 0 = a free port)")
    p.add_argument("--http-port", type=int, help="HTTP port (default 8000; 0 = a free port)")
    p.add_argument("--token", help="bearer token every call must carry (default: $DUET_TOKEN if set)")
    p.add_argument("--insecure", action="store_true", default=None,
                   help="allow binding a non-loopback address without a token")
    p.add_argument("--tls-cert", help="PEM certificate chain (with --tls-key: serve TLS only)")
    p.add_argument("--tls-key", help="PEM private key")
    p.add_argument("--model-name", help="the model name clients use (default: the model directory's name)")
    p.add_argument("--max-concurrent", type=int, help="requests in flight before RESOURCE_EXHAUSTED / 429")
    p.add_argument("--max-visual-tokens", type=int,
                   help="visual tokens one request's images may take together (default 16384)")
    p.add_argument("--drain-timeout", type=float, dest="drain_timeout_s",
                   help="seconds in-flight requests may take to finish on shutdown (default 30)")
    p.add_argument("--address", help="join this Ray cluster (e.g. auto, or HOST:6379) instead of starting one; its "
                   "workers then outlive this process and a restart reattaches to them (see --name)")
    p.add_argument("--name", dest="detached_name",
                   help="with --address: the name this deployment's detached workers go by (default: duet); a "
                        "restart with the same name and configuration reattaches to them")


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    from cluster.demo import default_model_dir
    from cluster.serve.config import build_configs, read_config_file

    data = read_config_file(args.config) if args.config else {}
    for name in ("max_concurrent", "max_visual_tokens"):  # the limits that have flags
        if getattr(args, name) is not None:
            data.setdefault("serve", {}).setdefault("limits", {})[name] = getattr(args, name)
    overrides = {k: getattr(args, k) for k in ("host", "grpc_port", "http_port", "insecure", "tls_cert", "tls_key",
                                               "model_name", "drain_timeout_s")}
    overrides["token"] = args.token or os.environ.get("DUET_TOKEN") or None
    overrides["model_dir"] = args.model_dir
    if args.address:  # the Ray cluster outlives this process: so do the workers (cluster.control.reattach)
        data.setdefault("detached_name", args.detached_name or "duet")
    model_default = data.get("model_dir") or str(default_model_dir())
    spec, cfg = build_configs(data, overrides, model_default)  # every config error before Ray starts
    # read by Ray when it is imported: no Ray call of an old cluster's thread (metrics, a health ping) may start a
    # Ray of its own while the head watch (cluster.serve.head_watch) re-initialises this process's driver
    os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
    if args.address:
        from cluster.serve.head_watch import keep_driver_alive

        keep_driver_alive()  # a lost head is waited for (cluster.serve.head_watch), not the end of this process
        _ray_token_auth()

    import ray

    from cluster.control.disagg import DisaggCluster
    from cluster.control.ray_epoch import EPOCH

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="duet serve: %(levelname)s %(message)s")
    started = not ray.is_initialized()

    def init_ray() -> None:
        if args.address:
            ray.init(address=args.address, log_to_driver=False, configure_logging=False)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, spec.num_prefill + spec.num_decode),
                     include_dashboard=False, log_to_driver=False, configure_logging=False)

    if started:
        init_ray()
    phases = {"Ray": time.monotonic() - t0}  # config checks and imports included
    holder: list = [None]

    def rebuild() -> DisaggCluster:
        """After the Ray head was lost: drop the old cluster (its actors went with the head), reconnect this
        process's driver (the embedded cluster: start a new head) and start fresh workers."""
        old, holder[0] = holder[0], None
        if old is not None:  # once: a failed rebuild is tried again without it
            old.abandon()
        if not EPOCH.end(timeout_s=30):  # a Ray call under way when the driver shuts down would crash this process
            raise RuntimeError("Ray calls of the old cluster are still under way; the driver is not reset yet")
        ray.shutdown()
        init_ray()
        EPOCH.begin()
        holder[0] = DisaggCluster(spec)
        return holder[0]

    try:
        holder[0] = DisaggCluster(spec)
        phases["workers"] = time.monotonic() - t0 - phases["Ray"]
        asyncio.run(_serve(holder, cfg, rebuild if started else None, embedded=not args.address, started=(t0, phases)))
    finally:
        if holder[0] is not None:
            holder[0].shutdown()
        if started:
            ray.shutdown()
    print("duet serve: stopped", file=sys.stderr)
    return 0


def _ray_token_auth() -> None:
    """Ray 2.60's ``ray start --head`` turns token authentication on, and a driver joining it must say so: with a
    token at hand (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``) and no ``RAY_AUTH_MODE``
    chosen, send it (a head without authentication accepts such a driver as well)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(path)):
        os.environ["RAY_AUTH_MODE"] = "token"


async def _serve(holder: list, cfg, rebuild, *, embedded: bool, started: tuple[float, dict[str, float]]) -> None:
    from cluster.serve.head_watch import HeadWatch
    from cluster.serve.server import Server

    loop = asyncio.get_running_loop()
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            print("duet serve: aborting in-flight requests", file=sys.stderr, flush=True)
            force.set()
        else:
            print(f"duet serve: draining (up to {cfg.drain_timeout_s:.0f} s; signal again to abort)",
                  file=sys.stderr, flush=True)
            stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    server = Server(holder[0], cfg)
    await server.start()
    # without a rebuild (Ray was started by someone else in this process) a lost head is still refused, not waited on
    watch = HeadWatch(server, rebuild or _no_rebuild, restart_after_s=5.0 if embedded and rebuild else None)
    watch.start()
    gc.collect()  # start-up's leftovers go; what is loaded by now leaves the cyclic collector's scans (as the workers')
    gc.freeze()
    t0, phases = started
    total = time.monotonic() - t0
    phases["front-end"] = total - sum(phases.values())
    print(f"duet serve: started in {total:.2f} s ({', '.join(f'{k} {v:.2f} s' for k, v in phases.items())})",
          file=sys.stderr, flush=True)
    print(server.ready_line(), flush=True)
    try:
        await stop.wait()
    finally:
        await watch.stop()
        await server.stop(force=force)


def _no_rebuild():
    raise RuntimeError("this process did not start Ray, so it cannot start it again")
