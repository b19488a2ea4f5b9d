"""Workers that outlive their front-end: named detached actors, and a front-end that reattaches to them.

With ``ClusterSpec.detached_name`` set (``duet serve --address`` sets it: the Ray cluster is not the front-end's
own), each worker is a detached Ray actor named ``"<detached_name>:<worker id>"`` in the :data:`NAMESPACE` namespace,
and the cluster's record -- the data-plane secret and each worker's fingerprint (a digest of everything it was
started with) -- is kept in Ray's internal key-value store under ``duet/<detached_name>`` (msgpack, ``"v"``). A
front-end that dies (SIGKILL, OOM, a node restart of its own) leaves them running; the next one started with the same
name finds them (:func:`attach`): a worker whose fingerprint matches what this front-end would start, and which
answers within :data:`PING_S`, is reused -- reset first (:meth:`reset` on the actor: every request of the old
front-end ends, its blocks freed) -- and any other worker of that name is killed. Starting workers is what costs
a cold start tens of seconds (model load, kernel probes, an expert-parallel group); reattaching costs a ping.

Expert-parallel decode groups are reattached whole (:func:`place_groups`): a group whose every rank answers, is not
broken or stopped and is still joined to its fellows keeps running as it was (its placement and placement version
read back from the ranks, for the new front-end's expert router); a group missing a rank is killed and formed anew.
A clean shutdown (:meth:`forget`) kills the workers and deletes the record. The secret in the record is readable by
whoever can reach the Ray cluster's GCS, who can already run code on its nodes; it never leaves the cluster.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kv_transfer import ClusterSecret
from node_common import messages

logger = logging.getLogger(__name__)

NAMESPACE = "duet"
RECORD_VERSION = 1
PING_S = 5.0


def actor_name(detached_name: str, worker_id: str) -> str:
    return f"{detached_name}:{worker_id}"


def fingerprint(role: str, options: dict, kwargs: dict) -> str:
    """A digest of what a worker of ``role`` is started with (its Ray options and constructor arguments, less the
    secret, the worker id and its cores): equal fingerprints, interchangeable workers."""
    keep = {k: v for k, v in sorted(kwargs.items()) if k not in ("secret", "cpus", "worker_id")}
    blob = msgpack.packb([role, sorted(options.items()), keep], default=repr)
    return hashlib.sha256(blob).hexdigest()


@dataclass
class Attached:
    """What :func:`attach` found: the secret of the record (None without one) and the live workers to reuse, by
    worker id, with the epoch their polls must now carry."""

    secret: ClusterSecret | None = None
    workers: dict[str, tuple[str, Any, int, str]] = field(default_factory=dict)  # id -> (role, actor, poll epoch, fp)
    seen: set[str] = field(default_factory=set)  # every worker id of that name found (reused or killed)


def _kv():
    from ray.experimental import internal_kv

    return internal_kv


def _key(detached_name: str) -> bytes:
    return f"duet/{detached_name}".encode()


def recorded_secret(detached_name: str) -> ClusterSecret | None:
    """The data-plane secret the workers of ``detached_name`` were started with (None: no record, or auth off)."""
    rec = read_record(detached_name)
    return None if rec is None or rec.get("secret") is None else ClusterSecret(rec["secret"])


def read_record(detached_name: str) -> dict | None:
    raw = _kv()._internal_kv_get(_key(detached_name), namespace=NAMESPACE)
    if raw is None:
        return None
    try:
        rec = msgpack.unpackb(raw, raw=False)
    except Exception:  # noqa: BLE001 - a record this version cannot read is no record
        return None
    return rec if isinstance(rec, dict) and rec.get("v") == RECORD_VERSION else None


def write_record(detached_name: str, secret: ClusterSecret | None, workers: dict[str, list[str]]) -> None:
    """``workers``: ``{worker_id: [role, fingerprint]}``."""
    rec = {"v": RECORD_VERSION, "secret": None if secret is None else secret.__getstate__(), "workers": workers}
    _kv()._internal_kv_put(_key(detached_name), msgpack.packb(rec), overwrite=True, namespace=NAMESPACE)


def attach(detached_name: str, expected: dict[str, set[str]]) -> Attached:
    """Find the live workers of ``detached_name`` whose recorded fingerprint is one of ``expected[role]`` (a decode
    worker's differs by its expert-parallel rank) and reset them; kill every other actor of that name. Blocking (a
    ping each, :data:`PING_S` at most)."""
    import ray

    rec = read_record(detached_name)
    found = Attached(secret=None if rec is None or rec.get("secret") is None else ClusterSecret(rec["secret"]))
    prefix = actor_name(detached_name, "")
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix)]
    recorded = (rec or {}).get("workers", {})
    for name in names:
        worker_id = name[len(prefix):]
        found.seen.add(worker_id)
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # gone since it was listed
            continue
        role, fp = (recorded.get(worker_id) or [None, None])[:2]
        if role in expected and fp in expected[role]:
            try:
                reply = msgpack.unpackb(ray.get(actor.reset.remote("its front-end restarted"), timeout=PING_S))
                found.workers[worker_id] = (role, actor, int(reply["epoch"]), fp)
                continue
            except Exception as e:  # noqa: BLE001 - unresponsive or broken: replaced below
                logger.warning("detached worker %s did not answer (%s); starting a new one", name, e)
        else:
            logger.info("detached worker %s was started with another configuration; replacing it", name)
        ray.kill(actor)
    return found


def forget(detached_name: str) -> None:
    """A clean shutdown: no record left (the caller kills the workers)."""
    _kv()._internal_kv_del(_key(detached_name), namespace=NAMESPACE)


@dataclass(frozen=True)
class GroupState:
    """A live expert-parallel group found by :func:`place_groups`: its members by rank, the placement it runs (a
    ``SlotTable`` wire map) and the newest placement version any rank staged or runs (a new one must be newer)."""

    members: list[str]
    placement: dict
    version: int


def place_groups(workers: dict[str, tuple], world: int, num_decode: int) -> list[GroupState]:
    """Among the reattached workers (:attr:`Attached.workers`), the whole expert-parallel groups of ``world`` ranks,
    at most ``num_decode // world``, in the order of their lowest worker index. Every other decode worker -- a rank
    that did not answer, is broken or stopped, or whose fellows are gone -- is killed and dropped from ``workers``."""
    import ray

    ids = [w for w, (role, *_) in workers.items() if role == "decode"]
    by_key: dict[str, dict[int, tuple[str, dict]]] = {}
    for w in ids:
        try:
            st = messages.unpack(ray.get(workers[w][1].stats.remote(), timeout=PING_S))
        except Exception as e:  # noqa: BLE001 - unresponsive or broken: its group is formed anew
            logger.warning("detached decode worker %s did not report its group (%s)", w, e)
            continue
        ep = st.get("experts") or {}
        if ep.get("group") and ep.get("world") == world and not ep.get("broken") and not st.get("stopped"):
            by_key.setdefault(ep["group"], {})[ep["rank"]] = (w, ep)
    groups = []
    for ranks in by_key.values():
        if sorted(ranks) != list(range(world)) or len({ep["version"] for _, ep in ranks.values()}) != 1:
            continue
        groups.append(GroupState(members=[ranks[r][0] for r in range(world)], placement=ranks[0][1]["placement"],
                                 version=max(ep.get("wanted", ep["version"]) for _, ep in ranks.values())))
    groups.sort(key=lambda g: min(int(w.rsplit("-", 1)[1]) for w in g.members))
    groups = groups[:num_decode // world]
    kept = {w for g in groups for w in g.members}
    for w in ids:
        if w not in kept:
            ray.kill(workers.pop(w)[1])
    return groups
