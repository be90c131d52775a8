"""Measuring every worker's link to the master with ``LinkProbeRequest`` round trips.

One worker at a time (so that probes do not share the master's link): the best of
``ROUND_TRIPS`` empty round trips is the latency; then a payload towards the worker
with an empty answer times the master -> worker direction, and an empty request
answered with a payload times the other one. The probe size grows until a transfer
takes ``TARGET_TRANSFER_S`` (or reaches ``MAX_PROBE_BYTES``), so a slow link is
measured quickly and a fast one long enough to be accurate. Below the largest size
the transfer that met the target is timed again (``RATE_REPEATS`` in all) and the
fastest counts, as for the round trips: a pause of either process only ever slows a
transfer down, and one 256 KiB probe delayed 50 ms by a busy host read as 40 Mbit/s
on loopback and kept a worker out of the plan.
All timings are on the master's clock; the worker answers from its socket thread at once.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from hetconv.master.cluster import Cluster, WorkerHandle
from hetconv.master.plan import Participant
from hetconv.planning.perf_model import Link
from hetconv.protocol import LinkProbeReply, LinkProbeRequest

ROUND_TRIPS = 5
RATE_REPEATS = 2  # timings of the final probe size; the faster is the rate
FIRST_PROBE_BYTES = 256 * 1024
MAX_PROBE_BYTES = 16 * 1024 * 1024
TARGET_TRANSFER_S = 0.05
MIN_TRANSFER_S = 1e-6


def _round_trip_s(cluster: Cluster, worker: WorkerHandle, send_bytes: int,
                  reply_bytes: int) -> float:
    payload = np.zeros(send_bytes, np.uint8) if send_bytes else None
    rid = cluster.request_id()
    started = time.monotonic()
    cluster.send(worker, LinkProbeRequest(request_id=rid, reply_bytes=reply_bytes,
                                          payload=payload))
    reply = cluster.gather({rid: worker}, f"link probe of {worker.name}")[rid]
    assert isinstance(reply.message, LinkProbeReply)
    return reply.received_at - started


def _rate(cluster: Cluster, worker: WorkerHandle, rtt_s: float, down: bool) -> float:
    """Bytes per second one way: the probe grows until a transfer takes
    ``TARGET_TRANSFER_S``, and the rate is the fastest of ``RATE_REPEATS`` transfers of
    that size; a link whose ``MAX_PROBE_BYTES`` probe is under the target is timed by
    that one probe."""
    def transfer_s(size: int) -> float:
        seconds = _round_trip_s(cluster, worker, size if down else 0, 0 if down else size)
        return max(MIN_TRANSFER_S, seconds - rtt_s)

    size = FIRST_PROBE_BYTES
    while True:
        took = transfer_s(size)
        if size >= MAX_PROBE_BYTES:  # a fast link: its largest probe is long enough
            return size / took
        if took >= TARGET_TRANSFER_S:
            fastest = min([took] + [transfer_s(size) for _ in range(RATE_REPEATS - 1)])
            return size / fastest
        size = min(MAX_PROBE_BYTES, size * max(2, int(TARGET_TRANSFER_S / took)))


def probe_link(cluster: Cluster, worker: WorkerHandle) -> Link:
    """The worker's link as the master sees it: rates both ways and the round trip."""
    rtt_s = min(_round_trip_s(cluster, worker, 0, 0) for _ in range(ROUND_TRIPS))
    return Link(down_bytes_per_s=_rate(cluster, worker, rtt_s, down=True),
                up_bytes_per_s=_rate(cluster, worker, rtt_s, down=False), rtt_s=rtt_s)


def probe_links(cluster: Cluster, participants: list[Participant],
                report: Callable[[str], None] = print) -> list[Link | None]:
    """Per participant its link (None for the master's own device), one worker at a time."""
    links: list[Link | None] = []
    for participant in participants:
        if participant.worker is None:
            links.append(None)
            continue
        link = probe_link(cluster, participant.worker)
        links.append(link)
        report(f"hetconv: link to {participant.participant}: "
               f"{link.down_bytes_per_s * 8 / 1e6:.0f} Mbit/s down, "
               f"{link.up_bytes_per_s * 8 / 1e6:.0f} Mbit/s up, "
               f"round trip {link.rtt_s * 1e3:.2f} ms")
    return links
