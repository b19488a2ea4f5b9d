"""The disaggregated cluster's spec: validated on construction, cross-checked when the cluster is built."""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from decode_node.expert_tiers import TIER_POLICIES, TierConfig
from engine.config import DTYPES, ModelConfig, TextConfig
from engine.errors import InvalidRequestError
from kv_transfer import DEFAULT_LEASE, TRANSPORTS, get_manager_class
from node_common.core_share import board_directory
DATA_PLANE_AUTH = ("hmac", "off")
# ClusterSpec.local_prefill_tokens's default where prefill and decode workers share a CPU node: one default step budget
# (EngineConfig.max_num_batched_tokens). Such a prompt holds the decode batch for its step, as a colocated engine's
# would; on 2 cores the prefill worker's path costs more: 1,024-token prompts at 1 req/s, TTFT p50 184 ms / TPOT p50
# 4.65 ms prefilled here against 333 ms / 5.25 ms through the prefill worker (512 was the limit then)
LOCAL_PREFILL_TOKENS = 4096
PREFILL_NICE = 10  # a prefill worker sharing cores with decode workers (prefill_threads None)
VISION_SLICE_S = 0.05  # ClusterSpec.prefill_vision_slice_s where prefill workers take text prompts


@dataclass(frozen=True)
class ClusterSpec:
    """N prefill and M decode workers serving one model. Prefill and decode share model, dtype and block size by
    construction (one spec feeds both sides), so their KV layouts always agree."""

    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "gloo"
    # the KV data plane: "hmac" (default) admits a peer only with its lease's token and MACs every frame with a key
    # derived from a per-cluster secret (kv_transfer.auth); "off" trusts whatever reaches the workers' ports
    data_plane_auth: str = "hmac"
    # "host:port" of an HTTP CONNECT proxy the prefill workers dial the decode workers' KV endpoints through (a
    # transport with dials_through_proxy: grpc); the chaos soak's stalling / corrupting proxy. None: direct
    kv_proxy: str | None = None
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    # a prefill worker's step budget (None: max_num_batched_tokens); every prompt of a step has its KV at the step's
    # end, so a smaller budget returns a burst's first prompts sooner where a step's time grows with its tokens (CPU),
    # at the cost of chunking prompts that do not fit
    prefill_max_batched_tokens: int | None = None
    max_model_len: int | None = None
    cpus_per_worker: float = 1.0
    # pin each worker's process to cores of its own (single-node CPU runs): workers take consecutive blocks of
    # max(1, int(cpus_per_worker)) cores in spawn order (prefill first), wrapping around the machine's cores
    pin_cpus: bool = False
    # torch threads of each prefill worker. None: on CPU workers of a one-node cluster (not pinned), the node's cores
    # shared out over the prefill workers, at a lower scheduling priority (nice PREFILL_NICE): decode steps come
    # first and prefill takes every core they leave idle; otherwise max(1, int(cpus_per_worker))
    prefill_threads: int | None = None
    # ... and there (prefill_threads None, sharing the node with decode workers): each step takes the threads the
    # other workers leave free (node_common.core_share), all of them when decode is idle, fewer while it steps
    prefill_adaptive_threads: bool = True
    decode_threads: int | None = None  # torch threads of each decode worker (None: max(1, int(cpus_per_worker)))
    # ... and where the workers share one CPU node's cores (decode_threads None): a decode step takes the cores the
    # others leave free while no prefill worker on the node has work (node_common.core_share.BusyBoard)
    decode_adaptive_threads: bool = True
    # text prompts of up to this many tokens are prefilled by their decode worker itself, in its own batch (no
    # prefill worker, no KV transfer), while it has no more than two such prompts' tokens of prefills pending
    # (cluster.control.admission.LOCAL_PENDING_PROMPTS);
    # those steps take the cores the other workers leave free. None: LOCAL_PREFILL_TOKENS where the workers share
    # one CPU node's cores (as for prefill_threads) and decode workers hold all experts; else 0 (off: a GPU host
    # runs one worker per GPU, and a prompt's prefill belongs to the prefill pool). See local_prefill()
    local_prefill_tokens: int | None = None
    # Qwen3-VL prefill workers run the vision tower in slices of about this many seconds ahead of scheduling
    # (EngineConfig.vision_slice_s), so a text prompt arriving during a large image's encoding waits one slice, not
    # the whole tower call; None: each image encoded whole in the step that schedules its prompt. "auto":
    # VISION_SLICE_S, or None where decode workers prefill text prompts themselves (see vision_slice())
    prefill_vision_slice_s: float | str | None = "auto"
    gpus_per_worker: float = 0.0
    stream_layers: bool = True
    request_timeout_s: float = 600.0
    # a decode worker's further tokens reach the front-end at most this often, several steps' at once (a first
    # token, an end or a failure at once): a reply per decode step cost the step a third of its time on a 2-core host
    # (decode_node.actor.DecodeActor.poll); 0: every step's tokens as soon as they exist
    stream_interval_s: float = 0.02
    # a decode worker on the front-end's node takes local prompts and streams its events over a loopback socket
    # (node_common.lane) instead of Ray calls: ~1 ms less each way on a 2-core host; false: Ray only
    fast_lane: bool = True
    # lease deadline = now + lease_base_s + bytes / lease_min_rate_bps (kv_transfer.lease.DEFAULT_LEASE)
    lease_base_s: float = DEFAULT_LEASE.base_s
    lease_min_rate_bps: float = DEFAULT_LEASE.min_rate_bps
    # prompt tokens a prefill worker may have between decode allocation and first token; more requests wait at the
    # front-end, not holding a lease whose deadline runs (None: 4 x max_num_batched_tokens)
    max_prefill_queue_tokens: int | None = None
    # a request that would wait for that room is refused at once (429 / RESOURCE_EXHAUSTED with a retry hint) when
    # the prefill pool's queued work, at the workers' measured speeds, would bring its first token after its
    # deadline (cluster.control.admission); False: it waits and times out instead
    refuse_when_overloaded: bool = True
    kv_compression: str | dict | None = "none"  # a policy name, JSON or dict (kv_transfer.compression)
    # workers as named detached Ray actors that outlive the front-end; the next front-end of this name reattaches to
    # them (cluster.control.reattach; `duet serve --address` sets "duet"). None: workers die with their front-end
    detached_name: str | None = None
    # expert parallelism: decode workers form groups of this size that share the experts (1: every decode worker
    # holds all experts); each worker has expert_slots_per_worker slots per MoE layer (None: ceil(experts / size))
    expert_parallel: int = 1
    expert_slots_per_worker: int | None = None
    expert_rebalance_s: float = 10.0  # the expert router's period (0: static placement unless forced)
    expert_max_moves: int | None = None  # per layer and rebalance; None: place from scratch
    expert_group_host: str = "127.0.0.1"  # group rendezvous address; "auto": rank 0's node IP (multi-node)
    expert_group_timeout_s: float = 60.0  # bounds the rendezvous and every collective of the group
    # tiered expert memory on each decode worker (decode_node.expert_tiers): a fraction (float) or count (int) of
    # each MoE layer's experts kept on the device, the rest in host memory (None: all resident); the policy that
    # pre-warms and evicts: "lru" (on demand) or "duet" (routing hints, forecast, look-ahead)
    expert_resident: float | int | None = None
    expert_cache_policy: str = "duet"
    extra_engine: dict = field(default_factory=dict)
    # Ray custom resources each worker of a pool asks for, placing it on that pool's nodes (deploy/ray/*.yaml mark
    # prefill and decode GPU nodes with duet_prefill / duet_decode); None: any node with the CPUs/GPUs
    prefill_resources: dict | None = None
    decode_resources: dict | None = None
    # self-healing pools (cluster.control.pool_healer): a dead worker is respawned with backoff unless it died
    # respawn_max_deaths times within respawn_window_s (0: never respawn); every live worker is pinged every
    # health_ping_s and one that does not answer within health_ping_timeout_s counts as dead
    respawn_max_deaths: int = 3
    respawn_window_s: float = 60.0
    health_ping_s: float = 2.0
    health_ping_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if not Path(self.model_dir, "config.json").is_file():
            raise InvalidRequestError(f"no checkpoint at {self.model_dir}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise InvalidRequestError("need at least one prefill and one decode worker")
        name = self.detached_name
        if name is not None and not (0 < len(name) <= 64 and name.replace("-", "").replace("_", "").isalnum()):
            raise InvalidRequestError(f"detached_name must be 1-64 letters, digits, '-' or '_', got {name!r}")
        if self.prefill_max_batched_tokens is not None and self.prefill_max_batched_tokens < 1:
            raise InvalidRequestError("prefill_max_batched_tokens must be >= 1 (or None)")
        if self.max_prefill_queue_tokens is not None and self.max_prefill_queue_tokens < 1:
            raise InvalidRequestError("max_prefill_queue_tokens must be >= 1 (or None)")
        for name in ("refuse_when_overloaded", "decode_adaptive_threads", "prefill_adaptive_threads", "fast_lane"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.refuse_when_overloaded, bool):
            raise InvalidRequestError(f"refuse_when_overloaded must be true or false, got "
                                      f"{self.refuse_when_overloaded!r}")
        if not (isinstance(self.stream_interval_s, (int, float)) and 0 <= self.stream_interval_s <= 0.1):
            raise InvalidRequestError(f"stream_interval_s must be within [0, 0.1] seconds, got "
                                      f"{self.stream_interval_s!r}")
        slice_s = self.prefill_vision_slice_s
        if not (slice_s is None or slice_s == "auto" or (isinstance(slice_s, (int, float))
                                                          and not isinstance(slice_s, bool) and slice_s > 0)):
            raise InvalidRequestError(f"prefill_vision_slice_s must be > 0, \"auto\" or None, got {slice_s!r}")
        if self.local_prefill_tokens is not None and (isinstance(self.local_prefill_tokens, bool) or not isinstance(
                self.local_prefill_tokens, int) or self.local_prefill_tokens < 0):
            raise InvalidRequestError(f"local_prefill_tokens must be an integer >= 0 (or None), got "
                                      f"{self.local_prefill_tokens!r}")
        for name in ("prefill_threads", "decode_threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be >= 1 (or None)")
        if self.transport not in TRANSPORTS:
            raise InvalidRequestError(f"unknown kv transport {self.transport!r} (choose from {', '.join(TRANSPORTS)})")
        if self.transport == "inproc":
            raise InvalidRequestError("the inproc transport only links workers in one process; use gloo or grpc "
                                      "between Ray actors")
        if self.data_plane_auth not in DATA_PLANE_AUTH:
            raise InvalidRequestError(f"data_plane_auth must be one of {', '.join(DATA_PLANE_AUTH)}, got "
                                      f"{self.data_plane_auth!r}")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {list(DTYPES)}")
        if self.kv_proxy is not None and not get_manager_class(self.transport).dials_through_proxy:
            raise InvalidRequestError(f"kv_proxy needs a transport that dials through a proxy (grpc), not "
                                      f"{self.transport!r}")
        if self.transport == "nccl" and self.gpus_per_worker <= 0:
            raise InvalidRequestError("the nccl transport needs GPU workers (gpus_per_worker > 0)")
        cfg = ModelConfig.from_pretrained(self.model_dir)  # fail here, not in an actor, on an unusable checkpoint
        self.compression_policy()  # raises on a bad policy
        self._check_expert_parallel(cfg.text)
        self._check_expert_tiers(cfg.text)
        self._check_resources()
        self.heal_policy()  # raises on a bad respawn setting

    def _check_expert_parallel(self, text: TextConfig) -> None:
        ep, slots = self.expert_parallel, self.expert_slots_per_worker
        if ep < 1:
            raise InvalidRequestError(f"expert_parallel must be >= 1, got {ep}")
        if self.num_decode % ep:
            raise InvalidRequestError(f"expert_parallel {ep} must divide num_decode {self.num_decode} (each group "
                                      f"of {ep} decode workers shares one copy of the experts)")
        if ep == 1:
            if slots is not None:
                raise InvalidRequestError("expert_slots_per_worker needs expert_parallel > 1")
            return
        if not text.is_moe:
            raise InvalidRequestError(f"expert_parallel {ep} needs an MoE model; {self.model_dir} is a dense "
                                      f"{text.model_type} model")
        if slots is not None and (slots < 1 or slots * ep < text.num_experts):
            raise InvalidRequestError(f"{ep} workers x {slots} expert slots cannot hold {text.num_experts} experts "
                                      f"(need expert_slots_per_worker >= {-(-text.num_experts // ep)})")
        if self.expert_max_moves is not None and self.expert_max_moves < 1:
            raise InvalidRequestError("expert_max_moves must be >= 1 (or None)")
        if self.expert_rebalance_s < 0 or self.expert_group_timeout_s <= 0:
            raise InvalidRequestError("expert_rebalance_s must be >= 0 and expert_group_timeout_s > 0")

    def _check_expert_tiers(self, text: TextConfig) -> None:
        if self.expert_cache_policy not in TIER_POLICIES:
            raise InvalidRequestError(f"unknown expert_cache_policy {self.expert_cache_policy!r} (choose from "
                                      f"{', '.join(TIER_POLICIES)})")
        if self.expert_resident is None:
            return
        if not text.is_moe:
            raise InvalidRequestError(f"expert_resident needs an MoE model; {self.model_dir} is a dense "
                                      f"{text.model_type} model")
        if self.expert_parallel > 1:
            raise InvalidRequestError("expert_resident (tiered expert memory) is not supported with expert_parallel "
                                      "> 1 yet")
        TierConfig(**self.tier_config()).capacity(sum(text.moe_layers), text.num_experts)  # a count above E raises

    def _check_resources(self) -> None:
        for name in ("prefill_resources", "decode_resources"):
            res = getattr(self, name)
            if res is None:
                continue
            if not isinstance(res, dict):
                raise InvalidRequestError(f"{name} must be a mapping of Ray resource name -> amount, got {res!r}")
            for key, amount in res.items():
                if not isinstance(key, str) or not key:
                    raise InvalidRequestError(f"{name}: resource names must be non-empty strings, got {key!r}")
                if key in ("CPU", "GPU", "memory", "object_store_memory"):
                    raise InvalidRequestError(f"{name}: {key} is set by cpus_per_worker / gpus_per_worker, not here")
                if isinstance(amount, bool) or not isinstance(amount, int | float) or amount <= 0:
                    raise InvalidRequestError(f"{name}.{key} must be a positive number, got {amount!r}")

    def actor_options(self, role: str) -> dict:
        """Ray ``.options()`` for a worker of ``role`` ("prefill" or "decode"): CPUs, GPUs and the pool's custom
        resources."""
        res = self.prefill_resources if role == "prefill" else self.decode_resources
        return dict(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, **({"resources": dict(res)} if res
                                                                                      else {}))

    def tier_config(self) -> dict | None:
        """The decode workers' :class:`decode_node.expert_tiers.TierConfig` as a dict (None: all experts resident).
        Raises InvalidRequestError on a bad fraction or count."""
        if self.expert_resident is None:
            return None
        return TierConfig(self.expert_resident, self.expert_cache_policy).to_dict()

    def slots_per_worker(self, num_experts: int) -> int:
        """Expert slots per decode worker and MoE layer (expert-parallel groups)."""
        return self.expert_slots_per_worker or -(-num_experts // self.expert_parallel)

    def heal_policy(self):
        """The :class:`cluster.control.pool_healer.HealPolicy` of this cluster's pools."""
        from cluster.control.pool_healer import HealPolicy

        return HealPolicy(max_deaths=self.respawn_max_deaths, window_s=self.respawn_window_s,
                          ping_interval_s=self.health_ping_s, ping_timeout_s=self.health_ping_timeout_s)

    def compression_policy(self) -> dict | None:
        """The KV compression policy as a dict for the workers (None: uncompressed)."""
        from kv_transfer.compression import InvalidPolicy, resolve_policy

        try:
            policy = resolve_policy(self.kv_compression)
        except InvalidPolicy as e:
            raise InvalidRequestError(f"kv_compression: {e}") from None
        return None if policy is None else policy.to_dict()

    def vision_slice(self, local_prefill: int = 0) -> float | None:
        """The prefill workers' vision slice (``prefill_vision_slice_s``), given the text prompts decode workers
        prefill themselves (:func:`local_prefill`). "auto" slices only where text prompts go to the prefill workers:
        slicing lets one through during an image's encoding, and costs the image itself (a 512² image on 2 shared
        cores: vision 207 ms whole against 242 ms in 0.05 s slices, 8 sequential requests)."""
        if self.prefill_vision_slice_s == "auto":
            return None if local_prefill > 0 else VISION_SLICE_S
        return self.prefill_vision_slice_s

    def engine_config(self, role: str, local_prefill: int = 0) -> dict:
        """EngineConfig fields for a worker of ``role`` (the same pool layout; prefill workers take their own step
        budget when ``prefill_max_batched_tokens`` is set, and the vision slice of :meth:`vision_slice`)."""
        budget = self.max_num_batched_tokens
        if role == "prefill" and self.prefill_max_batched_tokens is not None:
            budget = self.prefill_max_batched_tokens
        extra = dict(self.extra_engine)
        if role == "decode":  # a decode worker never encodes an image (its prompts come prefilled, or are text):
            extra.setdefault("vision_cache_mb", 0)  # no cache of encodings, and its engine neither loads nor tunes
            extra.setdefault("vision_tower", False)  # the tower (its prompts arrive without pixels)
            # received image KV stays coded in its cache where the policy codes it on the wire (engine.coded_kv) --
            # on CPU workers, whose compiled attention reads the codes; a GPU worker would dequantize the batch's
            # pages every layer and step (no GPU kernel yet), so it keeps them plain unless extra_engine says int8
            visual = (self.compression_policy() or {}).get("visual") or {}
            coded = visual.get("kind", "raw") != "raw" and self.gpus_per_worker == 0
            extra.setdefault("visual_kv_cache", "int8" if coded else "plain")
        if role == "prefill":  # a prefill worker never decodes: no staging to reserve
            extra.pop("decode_mirror_tokens", None)
            slice_s = self.vision_slice(local_prefill)
            if slice_s is not None:
                extra.setdefault("vision_slice_s", slice_s)
        return dict(dtype=self.dtype, device="cuda" if self.gpus_per_worker > 0 else "cpu",
                    block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=budget, max_model_len=self.max_model_len, **extra)

    def to_dict(self) -> dict:
        return asdict(self)


def prefill_threads(spec: ClusterSpec, nodes: int, cores: int | None = None) -> dict[str, int]:
    """``{"num_threads", "nice", "adaptive_threads"}`` of each prefill worker (``ClusterSpec.prefill_threads``). On
    CPU workers of a one-node cluster, not pinned and not set: the node's ``cores`` shared out over the prefill
    workers, at nice ``PREFILL_NICE`` so the decode workers' steps come first, each step on the threads the others
    leave free (``prefill_adaptive_threads``). E.g. 2 cores, 1 prefill + 1 decode: up to 2 threads at nice 10 (the
    decode worker keeps its 1 thread at normal priority), 1 while decode steps."""
    if spec.prefill_threads is not None:
        return {"num_threads": spec.prefill_threads, "nice": 0, "adaptive_threads": False}
    own = max(1, int(spec.cpus_per_worker))
    if spec.gpus_per_worker > 0 or spec.pin_cpus or nodes != 1:
        return {"num_threads": own, "nice": 0, "adaptive_threads": False}
    cores = cores or os.cpu_count() or 1
    threads = max(own, cores // spec.num_prefill)
    return {"num_threads": threads, "nice": PREFILL_NICE,
            "adaptive_threads": spec.prefill_adaptive_threads and threads > 1}


def local_prefill(spec: ClusterSpec, nodes: int, cores: int | None = None) -> int:
    """The text prompts each decode worker prefills itself: prompts of at most this many tokens, at most this many
    pending (``ClusterSpec.local_prefill_tokens``; 0: none). Off with expert-parallel groups or tiered experts (a
    prefill there would be a group collective or page experts in). Where the workers share one CPU node's cores
    (:func:`prefill_threads`'s case) a short text prompt gains most: on 2 cores, the serve-peer text workload's
    256-token prompts spent 70-100 ms in the prefill worker (its steps beside the decode worker's and the transfer's
    threads) against 42 ms for the same step alone on both cores, before transfer (5-8 ms), commit (3-7 ms) and
    submit (3-11 ms)."""
    if spec.expert_parallel > 1 or spec.expert_resident is not None:
        return 0
    if spec.local_prefill_tokens is not None:
        return spec.local_prefill_tokens
    shared = prefill_threads(spec, nodes, cores)["nice"] > 0
    return LOCAL_PREFILL_TOKENS if shared and spec.prefill_threads is None else 0


def decode_threads(spec: ClusterSpec, nodes: int, cores: int | None = None) -> dict[str, int]:
    """``{"num_threads", "max_threads", "adaptive_threads"}`` of each decode worker. ``num_threads``: its steps'
    threads (``ClusterSpec.decode_threads``, else ``max(1, int(cpus_per_worker))``). Where the workers share one CPU
    node's cores (:func:`prefill_threads`'s case, ``decode_threads`` unset) a step may take up to ``max_threads``
    (the node's cores over the decode workers), as many as the others leave free: one that prefills a local prompt
    (:func:`local_prefill`) always, and with ``adaptive_threads`` (``decode_adaptive_threads``) a decode step while
    no prefill worker on the node has work. A decode step of the serve-peer checkpoint (Intel Xeon, engine alone):
    3.3 -> 2.3 ms at batch 1, 6.8 -> 4.2 ms at batch 3 on two threads instead of one."""
    own = spec.decode_threads or max(1, int(spec.cpus_per_worker))
    shared = spec.decode_threads is None and prefill_threads(spec, nodes, cores)["nice"] > 0
    adaptive = shared and spec.decode_adaptive_threads and spec.expert_parallel == 1
    wide = max(own, (cores or os.cpu_count() or 1) // spec.num_decode)
    widen = adaptive or (shared and local_prefill(spec, nodes, cores) > 0)
    return {"num_threads": own, "max_threads": wide if widen else own, "adaptive_threads": adaptive}


@dataclass(frozen=True)
class NodeShare:
    """How a cluster's workers share their node's cores -- :func:`prefill_threads` (``prefill``),
    :func:`local_prefill` and :func:`decode_threads` (``decode``) -- and, where decode steps widen while the prefill
    workers are idle, the node's board that says whether they are (``board``, a directory:
    :class:`node_common.core_share.BusyBoard`; :meth:`close` removes it)."""

    prefill: dict
    local_prefill: int
    decode: dict
    board: str | None = None

    @classmethod
    def plan(cls, spec: ClusterSpec, nodes: int) -> NodeShare:
        decode = decode_threads(spec, nodes)
        board = board_directory(spec.detached_name or f"{os.getpid()}-{secrets.token_hex(4)}") \
            if decode["adaptive_threads"] else None
        return cls(prefill_threads(spec, nodes), local_prefill(spec, nodes), decode, board)

    def close(self) -> None:
        if self.board is not None:
            shutil.rmtree(self.board, ignore_errors=True)

    def actor_args(self, spec: ClusterSpec, role: str, *, secret: Any, cpus: list[int] | None,
                   expert_parallel: Any = None) -> tuple[dict, dict]:
        """(Ray options, constructor keyword arguments) of a new ``role`` worker of ``spec`` on this node."""
        common = {"num_threads": max(1, int(spec.cpus_per_worker)), "compression": spec.compression_policy(),
                  "cpus": cpus, "secret": secret, "insecure": spec.data_plane_auth == "off",
                  "model_dir": spec.model_dir, "engine_config": spec.engine_config(role, self.local_prefill),
                  "transport": spec.transport}
        if role == "prefill":
            extra = {"stream_layers": spec.stream_layers, "kv_proxy": spec.kv_proxy, **self.prefill,
                     "busy_board": self.board}
        else:
            extra = {"num_threads": self.decode["num_threads"],
                     "lease_base_s": spec.lease_base_s, "lease_min_rate_bps": spec.lease_min_rate_bps,
                     "expert_parallel": expert_parallel, "expert_tiers": spec.tier_config(),
                     "max_threads": self.decode["max_threads"], "busy_board": self.board}
        return {**spec.actor_options(role), "max_concurrency": 16}, {**common, **extra}
