"""deploy/Containerfile built and run with podman, from a local base image: no registry.

The base is a minimal Debian rootfs made here with ``debootstrap`` from the apt mirror
(python3 and python3-venv included, this machine's CA bundle copied in so that pip
trusts what this machine trusts) and ``podman import``-ed as
``localhost/hetconv-base:CODENAME`` (kept between runs, it takes about a minute to
make); the image is built from it with ``--build-arg base=...`` (pip installs hetconv's
dependencies from the package index inside the build, about half a minute) and run:
``hetconv --help``, ``hetconv worker --help``, the user it runs as, and a short
distributed run, master and worker each in its own container on the host's network.
The test image is removed at the end.

Root only; skips with the reason when podman, debootstrap or an OCI runtime that
works here is missing (deploy/test.sh installs podman, debootstrap and runc), or when
the base cannot be made. Where crun cannot start containers (cgroups v1 and v2 mounted
together) runc is used; the ulimits are set explicitly because podman's defaults may
exceed what this machine lets a process set.
"""
from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.lab, pytest.mark.slow]

MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def codename() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip('"') or "bookworm"
    return "bookworm"


BASE = f"localhost/hetconv-base:{codename()}"


def missing_reason() -> str | None:
    if os.geteuid() != 0:
        return "podman builds here need root"
    missing = [tool for tool in ("podman", "debootstrap") if shutil.which(tool) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed (apt-get install podman debootstrap "
                "runc; deploy/test.sh does)")
    return None


REASON = missing_reason()


def ulimits() -> list[str]:
    """Limits a container process may set here (at most this process's own)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nofile = 65536 if nofile == resource.RLIM_INFINITY else min(nofile, 65536)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def podman(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = (result.stderr.strip() or result.stdout.strip()).splitlines()
    return lines[-1] if lines else f"exit status {result.returncode}"


def make_base() -> None:
    """debootstrap a minimal rootfs and import it as BASE (skips with the error line)."""
    with tempfile.TemporaryDirectory(prefix="hetconv-rootfs-") as folder:
        rootfs = Path(folder) / "rootfs"
        result = subprocess.run(["debootstrap", "--variant=minbase",
                                 f"--include={BASE_PACKAGES}", codename(), str(rootfs), MIRROR],
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            pytest.skip(f"debootstrap failed: {last_line(result)}")
        if HOST_CA_BUNDLE.exists():  # trust what this machine trusts (a TLS proxy's CA)
            shutil.copyfile(HOST_CA_BUNDLE, rootfs / "etc/ssl/certs/ca-certificates.crt")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["podman", "import", "-", BASE], stdin=tar.stdout,
                                  capture_output=True, text=True, timeout=300)
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
        if imported.returncode != 0:
            pytest.skip(f"podman import failed: {last_line(imported)}")


@pytest.fixture(scope="module")
def runtime() -> list[str]:
    """Global podman flags of an OCI runtime that starts containers here."""
    if REASON is not None:
        pytest.skip(REASON)
    if podman("image", "exists", BASE).returncode != 0:
        make_base()
    errors = []
    for flags in ([], ["--runtime", "runc"]):
        if flags and shutil.which("runc") is None:
            errors.append("runc is not installed")
            continue
        result = podman(*flags, "run", "--rm", *ulimits(), BASE, "true", timeout=120)
        if result.returncode == 0:
            return flags
        errors.append(last_line(result))
    pytest.skip(f"podman cannot start a container here: {'; '.join(errors)}")


@pytest.fixture(scope="module")
def image(runtime: list[str]) -> Iterator[str]:
    tag = f"localhost/hetconv:test-{os.getpid()}"
    started = time.monotonic()
    built = podman(*runtime, "build", *ulimits(), "--build-arg", f"base={BASE}", "-f",
                   str(REPO / "deploy/Containerfile"), "-t", tag, str(REPO), timeout=900)
    seconds = time.monotonic() - started
    try:
        assert built.returncode == 0, f"podman build failed after {seconds:.0f} s:\n" + \
            (built.stdout + built.stderr)[-3000:]
        yield tag
    finally:
        podman("rmi", "-f", tag, timeout=120)


def run(runtime: list[str], image: str, *args: str, timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    return podman(*runtime, "run", "--rm", *ulimits(), image, *args, timeout=timeout)


@pytest.mark.timeout(1800)
def test_the_image_builds_from_a_local_base_runs_hetconv_and_trains(runtime: list[str],
                                                                   image: str) -> None:
    """One test, so that the base and the image are made once (pytest-xdist would build
    them again on each worker that runs a test of this module)."""
    usage = run(runtime, image, "--help")
    assert usage.returncode == 0, usage.stderr
    assert usage.stdout.startswith("usage: hetconv") and "worker" in usage.stdout, usage.stdout
    worker = run(runtime, image, "worker", "--help")
    assert worker.returncode == 0, worker.stderr
    assert "--master MASTER" in worker.stdout and "--data-port" in worker.stdout, worker.stdout
    user = podman(*runtime, "run", "--rm", *ulimits(), "--entrypoint", "id", image, "-u")
    assert user.stdout.strip() == "10001", user.stdout + user.stderr
    a_master_and_a_worker_in_containers_train(runtime, image)


def a_master_and_a_worker_in_containers_train(runtime: list[str], image: str) -> None:
    """A short distributed run, master and worker each in its own container."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    master = f"tcp://127.0.0.1:{port}"
    name = f"hetconv-test-worker-{os.getpid()}"
    host = [*runtime, "run", "--rm", *ulimits(), "--network", "host"]
    started = podman(*host, "-d", "--name", name, image, "worker", "--master", master,
                     "--name", "boxed", "--threads", "1", "--once")
    if started.returncode != 0:
        pytest.skip(f"podman run --network host failed: {last_line(started)}")
    try:
        trained = podman(*host, image, "train", "--listen", master, "--min-workers", "1",
                         "--wait", "60", "--data", "synthetic", "--limit", "640",
                         "--test-limit", "64", "--arch", "4:8", "--epochs", "1", "--batch",
                         "64", "--threads", "1", "--no-progress", "--run-dir", "/tmp/run",
                         timeout=180)
    finally:
        podman("rm", "-f", name, timeout=60)
    assert trained.returncode == 0, (trained.stdout + trained.stderr)[-3000:]
    assert '"test_accuracy"' in trained.stdout and "boxed" in trained.stdout + trained.stderr, \
        (trained.stdout + trained.stderr)[-3000:]
