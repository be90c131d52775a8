"""deploy/Containerfile and deploy/k8s/ as far as a machine that pulls no images can test
them: the manifests parse, every hetconv command, flag and HETCONV_* variable in them
exists (the flags are parsed by hetconv's own parser and found in its --help), the
ports agree between flags, containers, the Service, the scrape annotations and the
image, and every key file a command names is mounted from the Secret."""
from __future__ import annotations

import os
import re
import shlex
from typing import Any

import pytest

from hetconv.commands.cli import build_parser
from tests.conftest import REPO

yaml = pytest.importorskip("yaml", reason="PyYAML is missing: pip install -e '.[test]'")

DEPLOY = REPO / "deploy"
FIELD_VALUES = {"spec.nodeName": "node-1", "status.podIP": "10.0.0.7"}


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in documents() if doc["kind"] == kind]


def pod_specs() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, its pod template) for every Job / DaemonSet / StatefulSet / Deployment."""
    return [(doc, doc["spec"]["template"]) for doc in documents()
            if doc["kind"] in ("Job", "DaemonSet", "StatefulSet", "Deployment")]


def container_env(container: dict[str, Any]) -> dict[str, str]:
    env = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
        else:
            env[entry["name"]] = FIELD_VALUES[entry["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def parse_container(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The container's hetconv command line, parsed by hetconv's parser with the
    container's environment (flags over HETCONV_* variables over defaults)."""
    with monkeypatch.context() as patch:
        for name in [n for n in os.environ if n.startswith("HETCONV_")]:
            patch.delenv(name)
        for name, value in container_env(container).items():
            patch.setenv(name, value)
        return build_parser().parse_args([str(arg) for arg in container["args"]])


def help_text(subcommand: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([subcommand, "--help"])
    return capsys.readouterr().out


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: int(port["containerPort"]) for port in container.get("ports", [])}


def endpoint_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_manifests_parse_and_name_what_they_are() -> None:
    kinds = sorted(doc["kind"] for doc in documents())
    assert kinds == ["DaemonSet", "Job", "Secret", "Service"]
    for doc in documents():
        assert doc["apiVersion"] and doc["metadata"]["name"]


def test_every_command_and_flag_exists(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    for _, template in pod_specs():
        for container in template["spec"]["containers"]:
            subcommand = container["args"][0]
            parsed = parse_container(container, monkeypatch)
            assert parsed.command == subcommand
            text = help_text(subcommand, capsys)
            for arg in container["args"][1:]:
                if str(arg).startswith("--"):
                    assert str(arg) in text, f"{subcommand} --help lacks {arg}"


def test_every_hetconv_variable_is_read_by_hetconv() -> None:
    """Each HETCONV_* set in a manifest, the image or the systemd unit is one hetconv reads."""
    source = "\n".join(path.read_text() for path in (REPO / "hetconv").rglob("*.py"))
    read = set(re.findall(r'env(?:_int|_float|_positive_int)?\("([A-Z_]+)"', source))
    read |= set(re.findall(r'"HETCONV_([A-Z_]+)"', source))
    used = set()
    for _, template in pod_specs():
        for container in template["spec"]["containers"]:
            used |= {name for name in container_env(container)}
    for path in (DEPLOY / "Containerfile", DEPLOY / "hetconv-worker.service"):
        used |= set(re.findall(r"\b(HETCONV_[A-Z_]+)=", path.read_text()))
    assert used, "no HETCONV_ variables found"
    unknown = sorted(name for name in used if name.removeprefix("HETCONV_") not in read)
    assert not unknown, f"set in deploy/ but read nowhere in hetconv/: {unknown}"


def test_ports_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    (service,) = by_kind("Service")
    service_ports = {port["name"]: port for port in service["spec"]["ports"]}
    (job,) = by_kind("Job")
    (master,) = job["spec"]["template"]["spec"]["containers"]
    master_args = parse_container(master, monkeypatch)
    master_ports = ports(master)
    assert endpoint_port(master_args.listen) == master_ports["zmq"] == \
        service_ports["zmq"]["port"]
    assert master_args.metrics_port == master_ports["metrics"] == service_ports["metrics"]["port"]
    for name, port in service_ports.items():
        assert port["targetPort"] in master_ports, name
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(key) == value for key, value in service["spec"]["selector"].items())

    exposed = {int(port) for port in re.findall(r"^EXPOSE (.+)$", (DEPLOY / "Containerfile")
                                                 .read_text(), re.M)[0].split()}
    for workload, template in pod_specs():
        annotations = template["metadata"].get("annotations", {})
        for container in template["spec"]["containers"]:
            parsed = parse_container(container, monkeypatch)
            assert set(ports(container).values()) <= exposed, workload["metadata"]["name"]
            if parsed.metrics_port is not None:
                assert int(annotations["prometheus.io/port"]) == parsed.metrics_port == \
                    ports(container)["metrics"]
            if parsed.command == "worker":
                host, port = parsed.master.removeprefix("tcp://").rsplit(":", 1)
                assert host == service["metadata"]["name"] and int(port) == \
                    service_ports["zmq"]["port"]
                assert parsed.data_port == ports(container)["data"]
                assert parsed.advertise == FIELD_VALUES["status.podIP"]


def test_key_files_come_from_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    (secret,) = by_kind("Secret")
    secret_keys = set(secret["stringData"])
    for workload, template in pod_specs():
        spec = template["spec"]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        for container in spec["containers"]:
            mounted: dict[str, str] = {}  # path in the container -> secret key
            for mount in container.get("volumeMounts", []):
                source = volumes[mount["name"]].get("secret")
                if source is None:
                    continue
                assert source["secretName"] == secret["metadata"]["name"]
                for item in source["items"]:
                    assert item["key"] in secret_keys, item
                    mounted[f"{mount['mountPath']}/{item['path']}"] = item["key"]
            parsed = parse_container(container, monkeypatch)
            for flag in ("curve_secret", "master_key"):
                path = getattr(parsed, flag, None)
                if path is not None:
                    assert path in mounted, f"{workload['metadata']['name']}: {path}"
            allow = getattr(parsed, "curve_allow", None)
            if allow is not None:
                assert any(path.startswith(allow + "/") and path.endswith(".key")
                           for path in mounted), allow
            if parsed.command == "worker":  # the worker's key pair and the master's public key
                assert mounted[parsed.curve_secret] == "worker.key_secret"
                assert mounted[parsed.master_key] == "master.key"


def test_containerfile_builds_from_the_repository() -> None:
    text = (DEPLOY / "Containerfile").read_text()
    assert re.search(r"^ARG gpu=0$", text, re.M), "the gpu build argument"
    for line in re.findall(r"^COPY (.+)$", text, re.M):
        *sources, _ = shlex.split(line)
        for source in sources:
            assert (REPO / source).exists(), f"COPY {source}: not in the repository"
    assert re.search(r'^ENTRYPOINT \["hetconv"\]$', text, re.M)
    extras = set(re.findall(r'"\.\[([a-z]+)\]"', text))
    pyproject = (REPO / "pyproject.toml").read_text()
    for extra in extras:
        assert re.search(rf"^{extra} = \[", pyproject, re.M), f"no extra {extra}"
    assert extras == {"metrics", "gpu"}


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in
                                        (DEPLOY / "slurm").glob("*.sbatch")))
def test_slurm_script_commands_exist(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``hetconv SUB --flag`` the sbatch script runs is in SUB's --help (the lab
    test tests/lab/test_slurm.py runs it for real where Slurm is installed)."""
    text = (REPO / path).read_text()
    calls = re.findall(r'(?:\$\{hetconv\[[@*]\]\}"?|hetconv) (train|worker|keygen|report)'
                       r'((?:\\\n|[^\n])*)', text)
    assert {sub for sub, _ in calls} >= {"train", "worker", "keygen", "report"}
    for subcommand, rest in calls:
        help_output = help_text(subcommand, capsys)
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", rest):
            assert flag in help_output, f"{path}: hetconv {subcommand} has no {flag}"
