"""``duet status`` against an in-process fake gRPC server that answers ``ClusterStatus`` only."""

from __future__ import annotations

import json
from concurrent import futures

import grpc
import pytest

from cluster.cli.main import main
from cluster.cli.status_cmd import status_table
from duet_client._proto.duet.v1 import duet_pb2 as pb
from duet_client._proto.duet.v1.duet_pb2_grpc import (
    DuetServicer,
    add_DuetServicer_to_server,
)
from duet_client.request import API_VERSION
from duet_client.types import message_to_dict

STATUS = pb.ClusterStatusResponse(
    api_version=API_VERSION, model="demo", transport="gloo", in_flight=3, max_concurrent=64, kv_usage=0.25,
    requests_served=41, workers=[
        pb.WorkerStatus(worker_id="prefill-0", role=pb.WORKER_ROLE_PREFILL, alive=True, waiting=2, running=1,
                        outstanding_tokens=900),
        pb.WorkerStatus(worker_id="decode-0", role=pb.WORKER_ROLE_DECODE, alive=True, running=3, receiving=1,
                        free_blocks=384, total_blocks=512)],
    experts=pb.ExpertSummary(num_layers=2, num_experts=8, tokens_routed=1000, balancedness=[0.5, 0.7],
                             hottest_expert=[1, 2], placement="round-robin"))


class _Fake(DuetServicer):
    def ClusterStatus(self, request, context):
        return STATUS


@pytest.fixture(scope="module")
def target():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    add_DuetServicer_to_server(_Fake(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_status_prints_the_cluster_table(target, capsys):
    assert main(["status", "--target", target]) == 0
    out = capsys.readouterr().out
    assert "model demo, transport gloo, in flight 3/64, served 41, decode KV use 25%" in out
    lines = {ln.split()[0]: ln.split() for ln in out.splitlines() if ln.startswith(("prefill-0", "decode-0"))}
    assert lines["prefill-0"] == ["prefill-0", "prefill", "yes", "2", "1", "0", "900", "-"]
    assert lines["decode-0"] == ["decode-0", "decode", "yes", "0", "3", "1", "0", "128/512"]
    assert "balancedness min 0.50 mean 0.60" in out


def test_status_json(target, capsys):
    assert main(["status", "--target", target, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["workers"][1]["role"] == "WORKER_ROLE_DECODE" and got["kv_usage"] == 0.25


def test_unreachable_server_is_an_error_line(capsys):
    assert main(["status", "--target", "127.0.0.1:1", "--timeout", "0.5"]) == 1
    assert "duet status: error: UNAVAILABLE" in capsys.readouterr().err


def test_table_of_an_empty_status():
    assert "decode KV use 0%" in status_table({})


def test_the_table_shows_the_pool_healers_state():
    st = pb.ClusterStatusResponse(
        api_version=API_VERSION, model="demo", workers=[
            pb.WorkerStatus(worker_id="prefill-2", role=pb.WORKER_ROLE_PREFILL, alive=False,
                            healing=pb.WORKER_HEALING_GIVEN_UP),
            pb.WorkerStatus(worker_id="decode-1", role=pb.WORKER_ROLE_DECODE, alive=False,
                            healing=pb.WORKER_HEALING_RESPAWNING),
            pb.WorkerStatus(worker_id="decode-3", role=pb.WORKER_ROLE_DECODE, alive=False)],
        healing=pb.PoolHealing(prefill_respawns=2, decode_respawns=1, given_up=["prefill-2"], respawning=["decode-1"]))
    d = message_to_dict(st)
    assert d["workers"][0]["healing"] == "WORKER_HEALING_GIVEN_UP" and d["healing"]["given_up"] == ["prefill-2"]
    out = status_table(d)
    alive = {ln.split()[0]: ln.split()[2] for ln in out.splitlines() if ln.startswith(("prefill-", "decode-"))}
    assert alive == {"prefill-2": "NO/given-up", "decode-1": "NO/respawning", "decode-3": "NO"}
    assert ("healing: respawned 2 prefill / 1 decode; respawning decode-1; GIVEN UP (no longer respawned) prefill-2"
            in out)


def test_a_version_1_status_reads_as_no_healing():
    """A version-1 server's answer has neither field: every worker UNSPECIFIED, zero counts, no healing line."""
    old = pb.ClusterStatusResponse(api_version=1, workers=[pb.WorkerStatus(worker_id="decode-0", alive=True)])
    d = message_to_dict(pb.ClusterStatusResponse.FromString(old.SerializeToString()))
    assert d["workers"][0]["healing"] == "WORKER_HEALING_UNSPECIFIED" and d["healing"]["given_up"] == []
    assert "healing" not in status_table(d)
    assert "healing" not in status_table(message_to_dict(STATUS))
