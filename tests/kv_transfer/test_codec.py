"""Codec, frame headers, lease messages and small pure helpers (no transport)."""

from __future__ import annotations

import ast
import pathlib
import time

import msgpack
import pytest
import torch

import kv_transfer
from kv_transfer import (
    TRANSPORTS,
    ChecksumMismatch,
    IdentityCodec,
    KVLayout,
    KVManager,
    KVPoll,
    Lease,
    PeerUnavailable,
    ProtocolError,
    frames,
    get_codec,
    get_manager_class,
    transfer_deadline,
)
from kv_transfer.codec import block_checksums, decode_layer, encode_layer
from kv_transfer.grpc.server import pack_summary, unpack_summary
from kv_transfer.link import Outbox
from tests.kv_transfer.kvutil import make_kv, make_layout


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_identity_codec_round_trip_is_bit_exact(dtype: str) -> None:
    layout = make_layout(dtype)
    k, v = make_kv(layout, 3, seed=1, layer=0)
    header, payload = encode_layer("r", 0, k, v, IdentityCodec())
    assert payload.dtype == torch.uint8 and payload.numel() == layout.layer_nbytes(3) == header["nbytes"]
    assert header["shape"] == [2, 3, 4, 2, 8] and header["dtype"] == dtype and header["codec"] == "identity"
    assert header["first_block"] == 0 and header["num_blocks"] == 3 and len(header["checksums"]) == 3
    k2, v2, dropped = decode_layer(msgpack.unpackb(msgpack.packb(header)), payload.clone(), layout)
    assert k2.dtype == k.dtype and torch.equal(k2, k) and torch.equal(v2, v) and dropped is None


@pytest.mark.parametrize("block", [0, 2, 4])
@pytest.mark.parametrize("plane", [0, 1])
def test_checksums_name_the_corrupted_block(block: int, plane: int) -> None:
    layout = make_layout("bfloat16")
    header, payload = encode_layer("r", 1, *make_kv(layout, 5, seed=2, layer=1), IdentityCodec())
    per_block = header["codec_meta"]["planes"][0] // 5
    payload[plane * payload.numel() // 2 + block * per_block + 3] ^= 1
    with pytest.raises(ChecksumMismatch, match=rf"block\(s\) \[{block}\]"):
        decode_layer(header, payload, layout)


def test_block_checksums_need_planes_that_split_into_blocks() -> None:
    with pytest.raises(ProtocolError):
        block_checksums(torch.zeros(10, dtype=torch.uint8), [5, 5], 2)


def test_decode_rejects_frames_that_do_not_match_the_layout() -> None:
    layout = make_layout("float32")
    header, payload = encode_layer("r", 0, *make_kv(layout, 2, seed=0, layer=0), IdentityCodec())
    with pytest.raises(ProtocolError, match="layout"):
        decode_layer(header, payload, make_layout("bfloat16"))
    with pytest.raises(ProtocolError, match="bytes"):
        decode_layer(header, payload[:-4], layout)
    with pytest.raises(ProtocolError, match="unknown codec"):
        decode_layer({**header, "codec": "zstd-9000"}, payload, layout)
    with pytest.raises(ProtocolError, match="unknown codec"):
        get_codec("zstd-9000")


def test_every_frame_carries_the_version() -> None:
    layout = make_layout()
    codec_header, _ = encode_layer("r", 0, *make_kv(layout, 1, seed=0, layer=0), IdentityCodec())
    built = [frames.open_frame("r"), frames.layer_frame(codec_header), frames.finish_frame("r", {"t": 1}),
             frames.abort_frame("r", frames.TO_SENDER, ChecksumMismatch("x")), frames.done_frame("r"),
             frames.link_frame("ping"), frames.link_frame("bye")]
    for header in built:
        assert frames.unpack(frames.pack(header)) == header
        assert header["v"] == frames.FRAME_VERSION == 1


def test_unknown_frame_version_is_rejected_with_its_request() -> None:
    with pytest.raises(frames.FrameRejected, match="version 2") as info:
        frames.unpack(frames.pack({**frames.finish_frame("req-9", {}), "v": 2}))
    assert isinstance(info.value, ProtocolError) and info.value.request_id == "req-9" and info.value.to == "receiver"
    with pytest.raises(frames.FrameRejected, match="version None"):
        frames.unpack(msgpack.packb({"kind": "open", "request_id": "x"}))
    with pytest.raises(frames.FrameRejected, match="not msgpack"):
        frames.unpack(b"\xc1\xc1\xc1")
    with pytest.raises(frames.FrameRejected, match="not a map"):
        frames.unpack(msgpack.packb([1, 2]))


def test_push_summary_is_versioned() -> None:
    assert unpack_summary(pack_summary(None)) == {"v": 1, "ok": True, "error": None, "reason": ""}
    assert unpack_summary(pack_summary(ChecksumMismatch("b")))["error"] == "ChecksumMismatch"
    with pytest.raises(ProtocolError):
        unpack_summary(msgpack.packb({"v": 7, "ok": True}))


def test_lease_round_trips_through_msgpack_with_a_version() -> None:
    lease = Lease("r1", 4, make_layout("bfloat16"), "gloo", "127.0.0.1:1234/d0", 1e9)
    d = msgpack.unpackb(msgpack.packb(lease.to_dict()))
    assert d["version"] == 3 and Lease.from_dict(d) == lease  # 3: start-counted clock (off here); 1 and 2 parse
    assert Lease.from_dict({k: v for k, v in d.items() if k not in ("start_by_s", "transfer_s")} | {"version": 2}) \
        == lease
    with pytest.raises(ProtocolError, match="version 4"):
        Lease.from_dict({**d, "version": 4})
    with pytest.raises(ProtocolError, match="version None"):
        Lease.from_dict({k: v for k, v in d.items() if k != "version"})
    with pytest.raises(ProtocolError, match="malformed"):
        Lease.from_dict({**d, "layout": {"num_layers": 1}})
    with pytest.raises(ValueError):
        Lease("", 4, lease.layout, "gloo", "e", 1.0)


def test_layout_validates_and_sizes() -> None:
    layout = KVLayout(num_layers=2, block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16")
    assert layout.layer_nbytes(3) == 2 * 3 * 16 * 4 * 64 * 2 and layout.transfer_nbytes(3) == 2 * layout.layer_nbytes(3)
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(2, 16, 4, 64, "int8")
    with pytest.raises(ValueError, match="block_size"):
        KVLayout(2, 0, 4, 64, "float32")


def test_a_lease_clock_starts_with_its_transfer_when_asked() -> None:
    """LeasePolicy.queued / Lease.due_s: the module's worked example (100 MB at 5 s + 50 MB/s needs 7 s)."""
    from kv_transfer.lease import MAX_QUEUE_S, LeasePolicy

    now = time.time()
    f = LeasePolicy().queued(100_000_000, now + 600)
    assert f["transfer_s"] == pytest.approx(7.0) and f["start_by_s"] == pytest.approx(now + 600, abs=1)
    lease = Lease("r", 4, make_layout("float32"), "gloo", "e", **f)
    assert lease.due_s(None) == f["start_by_s"] and lease.due_s(now + 42) == pytest.approx(now + 49)
    assert lease.latest_s == pytest.approx(now + 607, abs=1)
    assert Lease.from_dict(msgpack.unpackb(msgpack.packb(lease.to_dict()))) == lease
    assert LeasePolicy().queued(0, None)["start_by_s"] is None  # no start_by: the clock runs from issue
    assert LeasePolicy().queued(0, now - 1)["start_by_s"] is None  # already past: from issue as well
    assert LeasePolicy().queued(0, now + 1e9)["start_by_s"] <= time.time() + MAX_QUEUE_S
    with pytest.raises(ValueError, match="together"):
        Lease("r", 4, make_layout("float32"), "gloo", "e", now, start_by_s=now + 1)


def test_transfer_deadline_scales_with_bytes() -> None:
    now = time.time()
    assert now + 5.0 <= transfer_deadline(0) <= time.time() + 5.0
    d = transfer_deadline(100e6, base_s=1.0, min_rate_bps=50e6)  # 100 MB at 50 MB/s: 2 s
    assert now + 3.0 <= d <= time.time() + 3.0


def test_poll_states_are_ordered() -> None:
    assert KVPoll.FAILED < KVPoll.BOOTSTRAPPING < KVPoll.WAITING < KVPoll.TRANSFERRING < KVPoll.SUCCESS


def test_outbox_sends_control_frames_first() -> None:
    box = Outbox()
    box.put("job-1")  # type: ignore[arg-type]  (any non-dict is a data job)
    box.put({"kind": "abort"})
    assert box.get(0) == {"kind": "abort"} and box.get(0) == "job-1" and box.get(0) is None
    box.put({"kind": "bye"}, last=True)
    assert not box.put({"kind": "late"}) and box.get(0) == {"kind": "bye"} and box.get(0) is None


def test_registry_and_capabilities() -> None:
    assert TRANSPORTS == ("inproc", "gloo", "nccl", "grpc")
    for name in TRANSPORTS:
        cls = get_manager_class(name)
        assert issubclass(cls, KVManager) and cls.name == name
        assert all(isinstance(getattr(cls, f), bool) for f in ("supports_gpu_direct", "cross_process", "cross_host"))
    assert get_manager_class("nccl").supports_gpu_direct and not get_manager_class("inproc").cross_process
    with pytest.raises(ValueError, match="unknown KV transport"):
        get_manager_class("rdma")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_nccl_needs_cuda() -> None:
    with pytest.raises(PeerUnavailable, match="CUDA"):
        get_manager_class("nccl")(insecure=True)


def test_package_does_not_import_the_model() -> None:
    root = pathlib.Path(kv_transfer.__file__).parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "engine" or n.startswith("engine.") for n in names), path
