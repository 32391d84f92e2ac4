"""Two hosts that reach each other only over a network: two network namespaces joined by a veth
pair, each running ``torchrun --nnodes 2 --node-rank i --rdzv-endpoint <host 0's address>:PORT``
with its own store. They must train exactly as the same two hosts do on loopback (each rank
alone on its host, so with the same threads), bit for bit, and each keep its own store.

Skipped, saying why, where namespaces cannot be made (not root, no ``ip``, a container that
forbids them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from offload.manifest import read_committed
from tests.engine.test_host_crash import finish, launch, losses, masters, train_args

pytestmark = pytest.mark.slow  # two torchrun agents and a reference run: about 40 s here

ADDRESSES = ("10.77.0.1", "10.77.0.2")
STEPS = 3


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def namespaces() -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair, named for this process (others may be
    running the same test), removed afterwards with the pair."""
    names = (f"hosts{os.getpid()}a", f"hosts{os.getpid()}b")
    try:
        if shutil.which("ip") is None:
            raise OSError("the ip command (iproute2) is not installed")
        for name in names:
            ip("netns", "add", name)
        ip("link", "add", f"{names[0]}v", "type", "veth", "peer", "name", f"{names[1]}v")
        for name, address in zip(names, ADDRESSES, strict=True):
            ip("link", "set", f"{name}v", "netns", name)
            ip("-n", name, "addr", "add", f"{address}/24", "dev", f"{name}v")
            ip("-n", name, "link", "set", f"{name}v", "up")
            ip("-n", name, "link", "set", "lo", "up")
    except (OSError, subprocess.CalledProcessError) as err:
        _remove(names)
        why = err.stderr.strip() if isinstance(err, subprocess.CalledProcessError) else str(err)
        pytest.skip(f"cannot make network namespaces here ({why}): run as root with iproute2")
    yield names
    _remove(names)


def _remove(names: tuple[str, str]) -> None:
    for name in names:  # deleting a namespace deletes its end of the pair, and so the pair
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_hosts_in_network_namespaces_train_as_on_loopback(tmp_path, namespaces) -> None:
    stores, metrics = str(tmp_path / "node-{node}"), tmp_path / "metrics.jsonl"
    procs = []
    for node, name in enumerate(namespaces):
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node)]
        torchrun += ["--nproc-per-node", "1", "--rdzv-endpoint", f"{ADDRESSES[0]}:29500", "-m", "engine"]
        command = ["ip", "netns", "exec", name, *torchrun, *train_args(stores, STEPS, metrics)]
        # Each namespace's hostname resolves to its loopback: gloo is told which interface is the network.
        env = os.environ | {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": f"{name}v"}
        log = open(tmp_path / f"host-{node}.log", "w")  # noqa: SIM115
        procs.append(subprocess.Popen(command, stderr=log, stdout=log, env=env))
    try:
        for node, proc in enumerate(procs):
            assert proc.wait(timeout=240) == 0, (tmp_path / f"host-{node}.log").read_text()[-3000:]
    finally:
        for proc in procs:
            proc.kill()

    loopback = tmp_path / "loopback.jsonl"
    (code, err), _ = finish(launch(str(tmp_path / "lo-{node}"), 2, STEPS, loopback, tmp_path, share_cores=False))
    assert code == 0, err[-3000:]
    assert losses(metrics) == losses(loopback) and len(losses(metrics)) == STEPS
    for node in range(2):
        assert read_committed(tmp_path / f"node-{node}")["step"] == STEPS
        assert masters(tmp_path / f"node-{node}") == masters(tmp_path / f"lo-{node}")
