"""TLS on both listeners (a self-signed certificate made with the ``openssl`` command): the SDK verifies the server
with the certificate as its root, a plaintext client cannot talk to it, and HTTPS serves the OpenAI API."""

from __future__ import annotations

import shutil
import ssl
import subprocess

import httpx
import pytest

from cluster.serve import ServeConfig, ServerThread
from duet_client import Client, TLSConfig, Unavailable
from tests.cluster.serve.test_server import SHAPES

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"), "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def tls_server(serve_cluster, cert):
    t = ServerThread(serve_cluster, ServeConfig(grpc_port=0, http_port=0, token="t", tls_cert=str(cert[0]),
                                                tls_key=str(cert[1])))
    srv = t.start()
    yield srv
    t.stop()


def test_sdk_over_tls(tls_server, cert):
    assert "tls" in tls_server.ready_line() and tls_server.http_url.startswith("https://")
    with Client(tls_server.grpc_target, token="t", tls=TLSConfig(root_certificates=cert[0])) as c:
        assert c.generate_text("<image>How many shapes are there?", images=[SHAPES]).text == "3"
    with Client(tls_server.grpc_target, token="t") as plain, pytest.raises(Unavailable):
        plain.list_models(timeout=3)


def test_https_openai_api(tls_server, cert):
    ctx = ssl.create_default_context(cafile=str(cert[0]))
    r = httpx.get(f"{tls_server.http_url}/v1/models", headers={"Authorization": "Bearer t"}, verify=ctx)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "duet-demo"
