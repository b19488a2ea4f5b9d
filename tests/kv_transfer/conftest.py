"""Fixtures for the KV-transfer tests.

* ``managers`` (module scope, parametrized over :data:`kvutil.TRANSPORTS` with ids): a ``(decode, prefill)`` pair
  of managers of one transport in this process, shared by a module's tests; after each test both must hold no
  live transfer (the transfer analogue of ``assert_no_leaked_blocks``).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kv_transfer import KVManager
from tests.kv_transfer.kvutil import TRANSPORTS, make_manager, wait_until


@pytest.fixture(scope="module", params=TRANSPORTS, ids=TRANSPORTS)
def _manager_pair(request: pytest.FixtureRequest) -> Iterator[tuple[KVManager, KVManager]]:
    decode, prefill = make_manager(request.param), make_manager(request.param)
    yield decode, prefill
    prefill.close()
    decode.close()


@pytest.fixture
def managers(_manager_pair: tuple[KVManager, KVManager]) -> Iterator[tuple[KVManager, KVManager]]:
    yield _manager_pair
    for m in _manager_pair:
        assert wait_until(lambda m=m: m.num_active() == 0, 5.0), f"{m.name}: {m.num_active()} transfers still live"
