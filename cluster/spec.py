"""The disaggregated cluster's spec: validated on construction, cross-checked when the cluster is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.config import DTYPES, ModelConfig
from engine.errors import InvalidRequestError

TRANSPORTS = ("inproc", "gloo", "nccl", "grpc")


@dataclass(frozen=True)
class ClusterSpec:
    """N prefill and M decode workers serving one model. Prefill and decode share model, dtype and block size by
    construction (one spec feeds both sides), so their KV layouts always agree."""

    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "gloo"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    stream_layers: bool = True
    request_timeout_s: float = 600.0
    lease_base_s: float = 5.0  # lease deadline = now + lease_base_s + bytes / lease_min_rate_bps
    lease_min_rate_bps: float = 50e6
    kv_compression: str | dict | None = "none"  # a policy name, JSON or dict (kv_transfer.compression)
    extra_engine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not Path(self.model_dir, "config.json").is_file():
            raise InvalidRequestError(f"no checkpoint at {self.model_dir}")
        if self.num_prefill < 1 or self.num_decode < 1:
            raise InvalidRequestError("need at least one prefill and one decode worker")
        if self.transport not in TRANSPORTS:
            raise InvalidRequestError(f"unknown kv transport {self.transport!r} (choose from {', '.join(TRANSPORTS)})")
        if self.transport == "inproc":
            raise InvalidRequestError("the inproc transport only links workers in one process; use gloo or grpc "
                                      "between Ray actors")
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {list(DTYPES)}")
        if self.transport == "nccl" and self.gpus_per_worker <= 0:
            raise InvalidRequestError("the nccl transport needs GPU workers (gpus_per_worker > 0)")
        ModelConfig.from_pretrained(self.model_dir)  # fail here, not in an actor, on an unusable checkpoint
        self.compression_policy()  # raises on a bad policy

    def compression_policy(self) -> dict | None:
        """The KV compression policy as a dict for the workers (None: uncompressed)."""
        from kv_transfer.compression import InvalidPolicy, resolve_policy

        try:
            policy = resolve_policy(self.kv_compression)
        except InvalidPolicy as e:
            raise InvalidRequestError(f"kv_compression: {e}") from None
        return None if policy is None else policy.to_dict()

    def engine_config(self, role: str) -> dict:
        """EngineConfig fields for a worker of ``role`` (prefill workers skip prefix-free... same pool layout)."""
        return dict(dtype=self.dtype, device="cuda" if self.gpus_per_worker > 0 else "cpu",
                    block_size=self.block_size, num_kv_blocks=self.num_kv_blocks, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                    **self.extra_engine)

    def to_dict(self) -> dict:
        return asdict(self)
