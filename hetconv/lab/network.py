"""Emulated LAN links: network namespaces joined by veth pairs capped with ``tc tbf``.

:class:`LanHost` is one namespace reached from the host over its own capped veth
(a star through the host). :class:`SwitchedLan` is the honest setup of a switched
LAN: a Linux bridge is the switch, and every machine (the master's included)
is a namespace attached to it by its own veth, capped in both directions, so the
master's link is one link and worker-to-worker traffic never crosses it. Needs root
and iproute2. Only addresses of namespaces made here receive traffic.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def netns_unavailable_reason() -> str | None:
    """Why network namespaces with veth links cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"hcprobe{os.getpid() % 100000}"
    result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        return f"ip netns add failed: {result.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def forwarding_unavailable_reason() -> str | None:
    """Why this host cannot route between :class:`LanHost` namespaces, or None: it must
    forward IPv4 (turned on here when it is off and /proc/sys lets root write it)."""
    path = "/proc/sys/net/ipv4/ip_forward"
    try:
        with open(path) as current:
            if current.read().strip() == "1":
                return None
        with open(path, "w") as switch:
            switch.write("1\n")
        return None
    except OSError as error:
        return f"the host does not forward IPv4 between namespaces ({path}: {error.strerror})"


class LanHost:
    """A network namespace reached from the host over a veth pair at ``rate``.

    The host side gets ``10.77.<index>.1``, the namespace ``10.77.<index>.2`` with its
    default route through the host, so namespaces reach each other when the host
    forwards IPv4 (:func:`forwarding_unavailable_reason`); both directions are capped
    with ``tc tbf`` when ``rate`` (e.g. ``"200mbit"``) is given.
    """

    def __init__(self, index: int, rate: str | None = None):
        if not 1 <= index <= 250:
            raise ValueError("index must be within 1..250")
        tag = f"{os.getpid() % 10000}x{index}"
        self.netns, self.host_if, self.peer_if = f"hc{tag}", f"hch{tag}", f"hcp{tag}"
        self.host_address, self.address = f"10.77.{index}.1", f"10.77.{index}.2"
        commands = [
            ["ip", "netns", "add", self.netns],
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.peer_if],
            ["ip", "link", "set", self.peer_if, "netns", self.netns],
            ["ip", "addr", "add", f"{self.host_address}/24", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            ["ip", "netns", "exec", self.netns, "ip", "addr", "add", f"{self.address}/24",
             "dev", self.peer_if],
            ["ip", "netns", "exec", self.netns, "ip", "link", "set", self.peer_if, "up"],
            ["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"],
            # the host routes between its namespaces (a routed LAN): worker-to-worker
            # traffic (the peer data plane) crosses both capped links
            ["ip", "netns", "exec", self.netns, "ip", "route", "add", "default", "via",
             self.host_address],
        ]
        if rate:
            tbf = ["root", "tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
            commands += [["tc", "qdisc", "add", "dev", self.host_if, *tbf],
                         ["ip", "netns", "exec", self.netns, "tc", "qdisc", "add", "dev",
                          self.peer_if, *tbf]]
        try:
            for command in commands:
                subprocess.run(command, capture_output=True, text=True, check=True)
        except subprocess.CalledProcessError as error:
            self.remove()
            raise RuntimeError(f"{' '.join(error.cmd)}: {error.stderr.strip()}") from None

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)


RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}


def parse_rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 bits per second (tc's units: bit, kbit, mbit, gbit)."""
    text = rate.strip().lower()
    for unit in ("kbit", "mbit", "gbit", "bit"):
        if text.endswith(unit):
            try:
                value = float(text[: -len(unit)])
            except ValueError:
                break
            if value > 0:
                return value * RATE_UNITS[unit]
    raise ValueError(f"rate {rate!r}: expected a number with bit, kbit, mbit or gbit, e.g. 1gbit")


def tbf_arguments(rate: str) -> list[str]:
    """``tc qdisc ... tbf`` arguments for ``rate`` with a burst of at least 10 ms of traffic."""
    burst_bytes = max(256 * 1024, int(parse_rate_bits(rate) / 8 / 100))
    return ["tbf", "rate", rate, "burst", str(burst_bytes), "latency", "100ms"]


def _run_all(commands: list[list[str]]) -> None:
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")


class LanMachine:
    """One machine of a :class:`SwitchedLan`: a namespace, its address, its switch port
    and its own end of the link (``interface``, inside the namespace)."""

    def __init__(self, netns: str, address: str, port: str, interface: str = ""):
        self.netns, self.address, self.port = netns, address, port
        self.interface = interface

    def link_bytes(self) -> tuple[int, int]:
        """(bytes the machine received, bytes it sent) so far, counted at its switch port."""
        stats = f"/sys/class/net/{self.port}/statistics"
        with open(f"{stats}/tx_bytes") as to_machine, open(f"{stats}/rx_bytes") as from_machine:
            return int(to_machine.read()), int(from_machine.read())

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this machine's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


class SwitchedLan:
    """``machines`` namespaces on one Linux bridge, each link capped at ``rate`` both ways
    (one cap for all, or one per machine).

    Machine ``i`` has address ``10.78.<lan>.<i + 1>/24``. ``remove()`` (or leaving the
    ``with`` block, also on Ctrl-C) deletes the namespaces, the veths and the bridge.
    """

    def __init__(self, machines: int, rate: str | Sequence[str] | None = None, lan: int = 1):
        if not 1 <= machines <= 200 or not 1 <= lan <= 250:
            raise ValueError("machines must be within 1..200 and lan within 1..250")
        rates = [rate] * machines if rate is None or isinstance(rate, str) else list(rate)
        if len(rates) == 1:
            rates *= machines
        if len(rates) != machines:
            raise ValueError(f"{len(rates)} link rates for {machines} machines")
        tag = f"{os.getpid() % 10000}{lan}"
        self.bridge = f"hcbr{tag}"
        self.machines: list[LanMachine] = []
        self._made_bridge = False
        try:
            _run_all([["ip", "link", "add", self.bridge, "type", "bridge"],
                      ["ip", "link", "set", self.bridge, "up"]])
            self._made_bridge = True
            for index in range(machines):
                netns, port, inner = f"hcm{tag}m{index}", f"hcs{tag}m{index}", f"hci{tag}m{index}"
                machine = LanMachine(netns, f"10.78.{lan}.{index + 1}", port, inner)
                commands = [
                    ["ip", "netns", "add", netns],
                    ["ip", "link", "add", port, "type", "veth", "peer", "name", inner],
                ]
                _run_all(commands)
                self.machines.append(machine)
                commands = [
                    ["ip", "link", "set", inner, "netns", netns],
                    ["ip", "link", "set", port, "master", self.bridge],
                    ["ip", "link", "set", port, "up"],
                    machine.command(["ip", "addr", "add", f"{machine.address}/24", "dev", inner]),
                    machine.command(["ip", "link", "set", inner, "up"]),
                    machine.command(["ip", "link", "set", "lo", "up"]),
                ]
                cap = rates[index]
                tbf = tbf_arguments(cap) if cap else None
                if tbf:  # switch -> machine at the port, machine -> switch inside
                    commands += [["tc", "qdisc", "add", "dev", port, "root", *tbf],
                                 machine.command(["tc", "qdisc", "add", "dev", inner, "root",
                                                  *tbf])]
                _run_all(commands)
        except BaseException:
            self.remove()
            raise

    def __enter__(self) -> SwitchedLan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def remove(self) -> None:
        for machine in self.machines:
            subprocess.run(["ip", "link", "del", machine.port], capture_output=True, check=False)
            subprocess.run(["ip", "netns", "del", machine.netns], capture_output=True,
                           check=False)
        self.machines = []
        if self._made_bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, check=False)
            self._made_bridge = False
