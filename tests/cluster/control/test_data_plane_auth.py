"""The authenticated data plane on a local Ray cluster: a stranger with no token is refused (typed, counted in the
decode worker's stats) while requests complete with the local engine's greedy tokens; the secret is in no log."""

from __future__ import annotations

import base64
import glob
import logging
import os
import time

import grpc
import pytest

from cluster.control.disagg import DisaggCluster
from cluster.control.spec import ClusterSpec
from engine import LLM
from kv_transfer import ClusterSecret, Unauthenticated
from kv_transfer.gloo import rendezvous
from kv_transfer.gloo.manager import parse_endpoint
from kv_transfer.grpc.server import PUSH
from node_common import messages
from tests.conftest import greedy, make_request

TRANSPORTS = ["gloo", "grpc"]
REFUSED = "KV data plane refused"  # the line a worker logs per refusal (kv_transfer.auth.Refusals.add)


def _stranger(transport: str, endpoint: str) -> None:
    if transport == "gloo":
        host, port, _ = parse_endpoint(endpoint)
        store = rendezvous.connect_store(host, port, 5.0)
        slot = rendezvous.announce(store, pair_key="stranger/1", prefill_id="stranger")
        with pytest.raises(Unauthenticated):
            rendezvous.prove(store, slot, pair_key="stranger/1", secret=ClusterSecret(b"x" * 32), timeout_s=10.0)
        return
    with grpc.insecure_channel(endpoint) as channel, pytest.raises(grpc.RpcError) as info:
        channel.stream_unary(PUSH)(iter([b"\x00" * 64]), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("transport", TRANSPORTS, ids=TRANSPORTS)
def test_stranger_is_refused_and_requests_match_local(transport, ray_cluster, tiny_model_dir, caplog, capfd):
    import ray

    caplog.set_level(logging.DEBUG)
    spec = ClusterSpec(model_dir=str(tiny_model_dir), local_prefill_tokens=0,
                       num_prefill=1, num_decode=1, transport=transport,
                       num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128, request_timeout_s=60)
    c = DisaggCluster(spec)
    try:
        key = c._secret._key
        decode = c.decodes[0].actor
        endpoint = messages.unpack(ray.get(decode.stats.remote(), timeout=30))["kv_endpoint"]
        refusals_logged = _ray_logs().count(REFUSED)  # the session's logs hold earlier tests' lines too
        _stranger(transport, endpoint)
        prompts = [make_request(6 + i, seed=40 + i) for i in range(3)]
        got = c.generate_batch(prompts, greedy(5))
        llm = LLM(tiny_model_dir, dtype="float32", num_kv_blocks=64, block_size=4, max_num_seqs=8, max_model_len=128)
        assert [g.token_ids for g in got] == [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(5))]
        stats = messages.unpack(ray.get(decode.stats.remote(), timeout=30))
        assert stats["kv_refused"] == {"Unauthenticated": 1}
        held = c.check_no_leaks()
        assert held and all(v == 0 for v in held.values()), held
    finally:
        c.shutdown()
    out, err = capfd.readouterr()
    time.sleep(0.5)  # let the workers' last lines reach their files
    worker_logs = _ray_logs()
    assert worker_logs.count(REFUSED) > refusals_logged  # the logs searched below are this run's workers'
    logs = out + err + caplog.text + worker_logs
    for form in (key.hex(), base64.b64encode(key).decode(), base64.urlsafe_b64encode(key).decode(), repr(key)):
        assert form not in logs


def test_auth_knob_is_validated(tiny_model_dir):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="data_plane_auth"):
        ClusterSpec(model_dir=str(tiny_model_dir), data_plane_auth="tls")


def _ray_logs() -> str:
    """The text of this Ray session's worker logs (actors log there: the driver has log_to_driver off). Raises when
    there is no log to read: an empty read would let "the secret is in no log" pass without looking."""
    import ray

    root = ray._private.worker._global_node.get_session_dir_path()
    paths = [p for p in glob.glob(os.path.join(root, "logs", "*"))
             if os.path.isfile(p) and p.endswith((".out", ".err", ".log"))]
    assert paths, f"no Ray log file under {root}/logs"
    text = []
    for path in paths:
        with open(path, errors="replace") as f:
            text.append(f.read())
    return "".join(text)
