"""The master's data endpoint handed to each worker is at its address toward that worker."""
from __future__ import annotations

from hetconv.master.data_ports import peers_seen_by


class FakePort:
    def endpoint(self, address: str) -> str:
        return f"tcp://{address}:7000"


PEERS = {"a": "tcp://127.0.0.1:5001", "b": "tcp://127.0.0.1:5002",
         "master": "tcp://192.0.2.1:7000"}


def test_the_master_is_at_its_address_on_the_route_to_the_receiver() -> None:
    seen = peers_seen_by("a", PEERS, FakePort())  # type: ignore[arg-type]
    assert seen == {**PEERS, "master": "tcp://127.0.0.1:7000"}  # loopback toward a
    assert PEERS["master"] == "tcp://192.0.2.1:7000"  # the shared map is left as it was


def test_without_a_master_port_or_for_an_unknown_receiver_nothing_changes() -> None:
    assert peers_seen_by("a", PEERS, None) == PEERS
    assert peers_seen_by("z", PEERS, FakePort()) == PEERS  # type: ignore[arg-type]
