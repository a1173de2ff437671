"""The base KVConnector is the no-op connector: it keeps no blocks, supplies no KV, and
refuses a load it never claimed; TransferEvents is true only when it reports a copy."""

from __future__ import annotations

import dataclasses

import pytest

from jaxkv.kv_transfer import KVConnector, TransferEvents, TransferStats
from tests.host._util import make_request


def test_the_noop_connector_keeps_nothing_claims_nothing_and_refuses_a_load():
    connector = KVConnector()
    request = make_request("r", range(1, 10))
    assert connector.on_finish(request, [1, 2]) is False
    assert connector.on_admission(request, 0) == 0
    assert connector.has_pending() is False
    assert connector.poll() == TransferEvents()
    assert isinstance(connector.stats, TransferStats)
    assert all(v == 0 for v in dataclasses.asdict(connector.stats).values())
    with pytest.raises(RuntimeError, match="start_load without a positive on_admission claim"):
        connector.start_load(request, [1, 2])


@pytest.mark.parametrize("field", ["saved", "failed_saves", "loaded", "failed_loads"])
def test_transfer_events_are_true_only_when_they_report_a_copy(field):
    assert not TransferEvents()
    assert TransferEvents(**{field: ("r",)})
