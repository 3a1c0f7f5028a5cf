"""A Ray cluster of real hosts on one machine: each host a Linux network namespace with its own
address, joined to the others by a veth pair on a bridge in the root namespace (which has an
address on it too, so `ray job submit` from here reaches the head's dashboard).

Needs root and iproute2 (`ip netns`, `ip link`); `skip_reason()` says why it cannot run.
Names (namespaces `pb<id>-<host>`, bridge `pbr<id>`, veths `pv<id>-<n>`) carry the pid of the
test process, and the subnet 10.77.<x>.0/24 is one no interface here uses yet (picked under a
lock file), so parallel runs never collide. Every host runs `ray start --block` (token auth,
its own `--temp-dir`) inside its namespace; the head has no CPUs (the job's driver, the
coordinator and the Tune and Train controllers need none), each worker host `cpus` CPUs and a
custom resource named after it (`host_<name>: 1`). Traffic stays on these addresses and each
namespace's loopback. `close()` SIGKILLs every process in each namespace (`ip netns pids`) and
deletes the veths, the bridge and the namespaces, also after a failed test.

Ray's failure detection is set on the head (`--system-config`, `HEALTH_CHECK`): a node whose
raylet answers no health check for `period x threshold` (about 3 s) is marked dead."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import os
import pathlib
import re
import secrets
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass

import yaml

from tests.helpers.processes import free_ports
from tests.helpers.ray_head import (
    BIN,
    HEAD_PORTS,
    head_command,
    node_port_flags,
    token_env,
    wait_for_dashboard,
)

SUBNET_PREFIX = "10.77"
LOCK_FILE = "/tmp/netns-cluster.lock"
HEALTH_CHECK = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
"""Ray's failure detection on these clusters (GCS health checks of every raylet): a node is
marked dead after 3 missed checks 1 s apart (Ray's defaults: 5 missed, 3 s apart, each with a
10 s timeout)."""
OBJECT_STORE = ["--object-store-memory", str(200 * 1024**2)]
"""Per host (Ray's default, 30% of memory, would claim most of /dev/shm with a few hosts)."""
NETNS_ETC = "/etc/netns"
_ids = itertools.count()


def skip_reason() -> str | None:
    """Why a namespace cluster cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is missing"
    probe = f"pbprobe{os.getpid():x}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> None:
    """Run `ip ARGS`; a failure raises with ip's own message."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")


def set_hostname(name: str) -> list[str]:
    """A command prefix that sets the hostname (of the UTS namespace it runs in), then runs
    the rest of the command in its place."""
    return ["sh", "-c", 'hostname "$0" && exec "$@"', name]


def namespace_pids(namespace: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def kill_namespace(namespace: str, timeout_s: float = 10) -> list[int]:
    """SIGKILL every process in `namespace` until none is left (children forked meanwhile
    included); the pids killed."""
    killed: list[int] = []
    deadline = time.time() + timeout_s
    while (pids := namespace_pids(namespace)) and time.time() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed += [p for p in pids if p not in killed]
        time.sleep(0.1)
    return killed


def used_subnets() -> set[int]:
    """The x of every 10.77.x.0/24 an interface of this machine has an address in."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    prefix = f" {SUBNET_PREFIX}."
    return {int(line.split(prefix, 1)[1].split(".")[0]) for line in out.splitlines() if prefix in line}


@dataclass
class Host:
    name: str
    namespace: str
    veth: str
    """The root namespace's end of the host's veth pair (on the bridge)."""
    address: str
    temp_dir: str
    process: subprocess.Popen | None = None

    @property
    def etc(self) -> str:
        """The files `ip netns exec` mounts over /etc in this host's namespace."""
        return os.path.join(NETNS_ETC, self.namespace)


class NetnsCluster:
    """A head and worker hosts, each in its own network namespace; see the module docstring."""

    def __init__(self, tmp_path, system_config: dict | None = None):
        self.id = f"{os.getpid():x}{next(_ids)}"
        self.tmp_path = pathlib.Path(tmp_path)
        """The folder of the hosts' Ray logs (`ray-<host>.log`), made here if missing: `make
        real-hosts` passes `.demo/real-hosts`, which a fresh clone lacks."""
        self.tmp_path.mkdir(parents=True, exist_ok=True)
        self.bridge = f"pbr{self.id}"
        self.subnet: int | None = None
        self.hosts: dict[str, Host] = {}
        self.system_config = {**HEALTH_CHECK, **(system_config or {})}
        self.env = token_env(secrets.token_hex(16), {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"})
        """The environment of the hosts' Ray processes, and of a client holding the cluster's
        token (`ray job submit`). Ray Train's state tracking is on: the dashboard's
        /api/train/v2/runs/v1 lists each run's workers with their node IP, node_rank and pid."""
        self.ports = free_ports(HEAD_PORTS)
        self._next_index = itertools.count(1)

    # Addresses.

    @property
    def head(self) -> Host:
        return self.hosts["head"]

    @property
    def dashboard(self) -> str:
        """The address for `ray job submit --address`, reached from the root namespace."""
        return f"http://{self.head.address}:{self.ports[1]}"

    @property
    def gcs_address(self) -> str:
        return f"{self.head.address}:{self.ports[0]}"

    def submit_study(self, raw: dict, work) -> str:
        """`ray job submit --no-wait -- playbook run study.yaml` from the root namespace, with
        `raw` written to `work`/study.yaml (the job's working dir); the job id."""
        work.mkdir(parents=True, exist_ok=True)
        (work / "study.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        cmd = [f"{BIN}/ray", "job", "submit", "--no-wait", "--address", self.dashboard]
        cmd += ["--working-dir", str(work), "--", "playbook", "run", "study.yaml"]
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return re.search(r"raysubmit_\w+", out.stdout + out.stderr).group(0)

    # Network.

    def make_bridge(self) -> None:
        """The bridge with the root namespace's address on a subnet no interface uses yet."""
        with open(LOCK_FILE, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            used = used_subnets()
            start = os.getpid() % 250
            self.subnet = next(x % 250 for x in range(start, start + 250) if x % 250 not in used)
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{SUBNET_PREFIX}.{self.subnet}.254/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")

    def make_host(self, name: str) -> Host:
        """A namespace joined to the bridge by a veth pair (`eth0` inside), loopback up, and an
        /etc/hosts of its own (`ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts) in
        which the host's name, its namespace's, resolves to its address."""
        index = next(self._next_index)
        host = Host(
            name=name,
            namespace=f"pb{self.id}-{name}",
            veth=f"pv{self.id}-{index}",
            address=f"{SUBNET_PREFIX}.{self.subnet}.{index}",
            temp_dir=f"/tmp/rn-{self.id}-{index}",  # short: Ray's socket paths have a length limit
        )
        self.hosts[name] = host
        ip("netns", "add", host.namespace)
        ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
        ip("link", "set", host.veth, "master", self.bridge)
        ip("link", "set", host.veth, "up")
        ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        ip("-n", host.namespace, "link", "set", "eth0", "up")
        ip("-n", host.namespace, "link", "set", "lo", "up")
        os.makedirs(host.etc, exist_ok=True)
        with open(os.path.join(host.etc, "hosts"), "w") as f:
            f.write(f"127.0.0.1 localhost\n{host.address} {host.namespace}\n")
        return host

    def link_down(self, name: str) -> None:
        """Cut the host off the network (its processes live on, unreachable)."""
        ip("link", "set", self.hosts[name].veth, "down")

    def link_up(self, name: str) -> None:
        ip("link", "set", self.hosts[name].veth, "up")

    # Ray.

    def start_head(self) -> Host:
        host = self.make_host("head")
        self.launch_head(host)
        return host

    def restart_head(self) -> Host:
        """A new head in the (emptied) head namespace, as after a lost head machine: a new GCS
        with no memory of the old cluster, on new ports (the old ones' sockets may linger)."""
        self.ports = free_ports(HEAD_PORTS)
        self.launch_head(self.head)
        return self.head

    def launch_head(self, host: Host) -> None:
        cmd = [
            *head_command(host.temp_dir, self.ports, num_cpus=0),
            "--node-ip-address",
            host.address,
            "--dashboard-host",
            "0.0.0.0",  # every address of the head's namespace: its eth0 and loopback
            "--system-config",
            json.dumps(self.system_config),
            *OBJECT_STORE,
        ]
        self.launch(host, cmd)
        wait_for_dashboard(self.dashboard, host.process, self.log_path(host))

    def add_host(self, name: str, cpus: int = 2) -> Host:
        """A worker host joined to the head: `cpus` CPUs and the resource `host_<name>`; returns
        once the head lists it alive."""
        host = self.make_host(name)
        self.join(host, cpus)
        return host

    def rejoin(self, name: str, cpus: int = 2) -> Host:
        """Start Ray again in a worker host's namespace (its Ray processes ended), joined to the
        head as it is now; returns once the head lists it alive."""
        host = self.hosts[name]
        self.join(host, cpus)
        return host

    def join(self, host: Host, cpus: int) -> None:
        name = host.name
        cmd = [
            f"{BIN}/ray",
            "start",
            "--block",
            "--disable-usage-stats",
            "--address",
            self.gcs_address,
            "--node-ip-address",
            host.address,
            "--num-cpus",
            str(cpus),
            "--resources",
            json.dumps({f"host_{name}": 1}),
            "--temp-dir",
            host.temp_dir,
            *node_port_flags(free_ports(6)),
            *OBJECT_STORE,
        ]
        self.launch(host, cmd)
        self.wait_alive(host)

    def launch(self, host: Host, cmd: list[str]) -> None:
        # A restarted host's log goes on after its first run's.
        log = open(self.log_path(host), "w" if host.process is None else "a")
        host.process = subprocess.Popen(
            # A hostname of its own (a UTS namespace), as a real host has: gloo binds the address
            # its host's name resolves to, which is loopback for this machine's own name.
            ["ip", "netns", "exec", host.namespace, "unshare", "--uts", *set_hostname(host.namespace), *cmd],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

    def log_path(self, host: Host):
        return self.tmp_path / f"ray-{host.name}.log"

    def nodes(self) -> list[dict]:
        """Ray's node table from the head's state API: node_id, node_ip, state, resources_total."""
        return self.state("nodes")

    def state(self, kind: str) -> list[dict]:
        """One of the head's state API tables (nodes, actors, tasks, placement_groups), detailed."""
        req = urllib.request.Request(
            f"{self.dashboard}/api/v0/{kind}?limit=1000&detail=true",
            headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)["data"]["result"]["result"]

    def what_runs(self) -> str:
        """The cluster's live actors, unfinished tasks and placement groups, one line each: what
        a job that does not end is waiting on."""
        actors = [a for a in self.state("actors") if a["state"] != "DEAD"]
        tasks = [t for t in self.state("tasks") if t["state"] not in ("FINISHED", "FAILED")]
        groups = [g for g in self.state("placement_groups") if g["state"] != "REMOVED"]
        lines = [
            f"actor {a['class_name']} {a['state']} pid {a.get('pid')} on {(a.get('node_id') or '')[:8]}"
            for a in actors
        ]
        lines += [f"task {t['name']} {t['state']} {(t.get('node_id') or '')[:8]}" for t in tasks]
        lines += [
            f"placement group {g['placement_group_id'][:8]} {g['state']} {g.get('bundles')}" for g in groups
        ]
        return "\n".join(lines)

    def wait_alive(self, host: Host, timeout_s: float = 120) -> None:
        deadline = time.time() + timeout_s
        while not any(n["node_ip"] == host.address and n["state"] == "ALIVE" for n in self.nodes()):
            if time.time() > deadline or host.process.poll() is not None:
                tail = self.log_path(host).read_text()[-2000:]
                raise RuntimeError(f"ray node {host.name} did not join: {tail}")
            time.sleep(0.5)

    def kill_host(self, name: str) -> list[int]:
        """SIGKILL every process of the host's namespace at once, no goodbye; the pids killed."""
        host = self.hosts[name]
        killed = kill_namespace(host.namespace)
        if host.process is not None:
            host.process.wait(timeout=30)
        return killed

    def close(self) -> None:
        """Kill every process of every host, then delete the veths, the bridge, the namespaces
        and the temp dirs; each step runs even if one before it failed."""
        for host in self.hosts.values():
            kill_namespace(host.namespace)
            if host.process is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    host.process.wait(timeout=30)
        for host in self.hosts.values():
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            shutil.rmtree(host.temp_dir, ignore_errors=True)
            shutil.rmtree(host.etc, ignore_errors=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        with contextlib.suppress(OSError):  # left for another cluster that still uses it
            os.rmdir(NETNS_ETC)


@contextlib.contextmanager
def netns_cluster(tmp_path, hosts: list[str], cpus: int = 2, system_config: dict | None = None):
    """A NetnsCluster with a head and one worker host per name in `hosts`, torn down after."""
    cluster = NetnsCluster(tmp_path, system_config)
    try:
        cluster.make_bridge()
        cluster.start_head()
        for name in hosts:
            cluster.add_host(name, cpus)
        yield cluster
    finally:
        cluster.close()
