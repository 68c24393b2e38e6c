"""bench/fanout: one model from one source to eight agents, each agent in its own network namespace
behind a veth pair whose egress is limited to 1 Gbit/s (tc tbf), all on one switch, and prints in one
run: one node's copy time, fleet's planned fan-out (fleet apply: chains that forward pieces as they
arrive), the tree fleet planned before (each holder serving two whole copies), every receiver from
the source at once, the bytes each link sent, and the ratio fan-out / one node.
Target: <= 1.3. Needs root (ip netns, veth, tc); agent homes on a tmpfs when memory allows.

    .venv/bin/python bench/fanout.py [--gib 1.0] [--receivers 8] [--rate 1gbit] [--rounds 3]
                                     [--no-baselines] [--fresh-memory]

The fan-out runs --rounds times in a row (each round's copies deleted before the next), and the ratio
is the median of every round but the first; each round's is printed. The first is a warm-up: in a
VM whose host takes back the memory the guest frees (free page reporting, a balloon), the first
write of a page it took back costs several times a warm one, and a fan-out writes a copy per
receiver, past what the guest keeps warm; eight real receivers each write into their own machine's
memory. On this machine the first round ran 1.75-1.97 x one node in cold spells and the later ones
1.3-1.5 (docs/ARCHITECTURE.md).

--fresh-memory prints first what a fresh page costs this machine: a plain write of the model's size
into a tmpfs of small pages and into one of huge pages, CPU-s per GiB (0.5-0.65 warm, 1.2-4.0 cold).

Every namespace, link and mount it makes is named with the prefix "ffan", and is removed when it
ends, whatever happens, and at its start if an earlier run was killed before it could."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.replication import make_file  # noqa: E402
from tests.agents import SECRET, agent_env  # noqa: E402
from tests.conftest import fleet_bin  # noqa: E402

PREFIX = "ffan"
BRIDGE = f"{PREFIX}br"
SWITCH = f"{PREFIX}sw"  # the namespace of the bridge
UPLINK = f"{PREFIX}up"  # the control plane's port on the switch, from the root namespace
SUBNET = "10.213.77"
PORT = 7070
AUTH = {"Authorization": f"Bearer {SECRET}"}


def sh(*args: str, check: bool = True, timeout: float = 30) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=check, timeout=timeout).stdout


def cleanup(mounts: list[Path]) -> None:
    """Remove every namespace and link named with the prefix, and the given tmpfs mounts."""
    for ns in sh("ip", "netns", "list", check=False).split("\n"):
        name = ns.split(" ")[0]
        if name.startswith(PREFIX):
            for pid in sh("ip", "netns", "pids", name, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)  # only processes inside our own namespaces
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", name, check=False)
    for line in sh("ip", "-o", "link", "show", check=False).split("\n"):
        parts = line.split(": ")
        if len(parts) > 1 and parts[1].split("@")[0].startswith(PREFIX):
            sh("ip", "link", "del", parts[1].split("@")[0], check=False)
    for m in mounts:
        sh("umount", "-l", str(m), check=False)


def stale_mounts() -> list[Path]:
    return [Path(line.split()[1]) for line in Path("/proc/mounts").read_text().splitlines()
            if f"/{PREFIX}-" in line.split()[1]]


class Net:
    """A switch (a bridge in a namespace of its own), the control plane's port on it (a veth pair from
    the root namespace) and one namespace per agent, each behind a veth pair into the switch.

    The switch runs no firewall, as a real one does not: where the bridge lived in the root namespace,
    this machine's `bridge-nf-call-iptables` (1 here, and it overrides a bridge's own setting) sent
    every frame of every hop through netfilter (br_nf_pre_routing, _forward_ip, _post_routing: a
    tenth of the fan-out's kernel CPU, 1.5-2 CPU-s of 8 GiB received). That switch is per namespace,
    so it is turned off in the switch's own, and the machine's is left as it is."""

    def __init__(self, rate: str, queue_ms: float) -> None:
        self.rate, self.queue_ms = rate, queue_ms
        sw = ("ip", "netns", "exec", SWITCH)
        sh("ip", "netns", "add", SWITCH)
        for table in ("iptables", "ip6tables", "arptables"):  # absent without br_netfilter: nothing to turn off
            sh(*sw, "sysctl", "-q", "-w", f"net.bridge.bridge-nf-call-{table}=0", check=False)
        sh(*sw, "ip", "link", "add", BRIDGE, "type", "bridge")
        sh(*sw, "ip", "link", "set", BRIDGE, "up")
        sh("ip", "link", "add", UPLINK, "type", "veth", "peer", "name", f"{UPLINK}s")
        sh("ip", "link", "set", f"{UPLINK}s", "netns", SWITCH)
        sh(*sw, "ip", "link", "set", f"{UPLINK}s", "master", BRIDGE)
        sh(*sw, "ip", "link", "set", f"{UPLINK}s", "up")
        sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", UPLINK)
        sh("ip", "link", "set", UPLINK, "up")

    def add(self, i: int) -> tuple[str, str]:
        ns, host, inner = f"{PREFIX}{i}", f"{PREFIX}h{i}", f"{PREFIX}n{i}"
        address = f"{SUBNET}.{10 + i}"
        sw = ("ip", "netns", "exec", SWITCH)
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "link", "set", host, "netns", SWITCH)
        sh(*sw, "ip", "link", "set", host, "master", BRIDGE)
        sh(*sw, "ip", "link", "set", host, "up")
        run = ("ip", "netns", "exec", ns)
        sh(*run, "ip", "addr", "add", f"{address}/24", "dev", inner)
        sh(*run, "ip", "link", "set", inner, "up")
        sh(*run, "ip", "link", "set", "lo", "up")
        # The node's uplink: what it sends, to peers and to the control plane, is limited here. A
        # node of a chain sends its downstream's data and its upstream's ACKs through this one FIFO
        # (this kernel has no fq_codel to keep them apart); with tbf's queue at 50 ms (6 MB at
        # 1 Gbit/s) the ACKs waited behind it and the upstream's transfer crawled (1 GiB through a
        # chain of eight took 105 s, against 77 s for eight from the source). A queue of a few ms is
        # what a real NIC keeps (byte queue limits).
        sh(*run, "tc", "qdisc", "add", "dev", inner, "root", "tbf", "rate", self.rate, "burst", "256kb",
           "latency", f"{self.queue_ms}ms")
        return ns, address

    @staticmethod
    def sent(ns: str, i: int) -> int:
        stats = json.loads(sh("ip", "netns", "exec", ns, "ip", "-j", "-s", "link", "show", f"{PREFIX}n{i}"))
        return int(stats[0]["stats64"]["tx"]["bytes"])


class Agents:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.nodes: dict[str, tuple[str, str, int]] = {}  # name → (namespace, address, index)

    def start(self, name: str, ns: str, address: str, i: int) -> None:
        home = self.root / name
        sh(fleet_bin("fleet-agent"), "enroll", "--home", str(home), "--name", name)
        log = open(self.root / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen(
            ["ip", "netns", "exec", ns, fleet_bin("fleet-agent"), "serve", "--home", str(home), "--listen",
             f"{address}:{PORT}", "--verify-every", "off", "--disk-reserve", "0"],
            env=agent_env(), stdout=log, stderr=subprocess.STDOUT))
        self.nodes[name] = (ns, address, i)

    def url(self, name: str) -> str:
        return f"http://{self.nodes[name][1]}:{PORT}"

    def wait_up(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for name in self.nodes:
            while True:
                try:
                    if httpx.get(self.url(name) + "/healthz", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(f"agent {name} did not answer within {timeout}s: "
                                     f"{(self.root / f'{name}.log').read_text()[-2000:]}")
                time.sleep(0.1)

    def cpu(self) -> float:
        """CPU seconds the agents have used (`ip netns exec` execs the agent: the pid is the agent's)."""
        return sum(self.cpu_split())

    def cpu_split(self) -> tuple[float, float]:
        """The agents' CPU seconds in user space and in the kernel (their writes, sends and receives)."""
        user = system = 0.0
        for p in self.procs:
            try:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            user += int(fields[11]) / os.sysconf("SC_CLK_TCK")
            system += int(fields[12]) / os.sysconf("SC_CLK_TCK")
        return user, system

    def sent(self) -> dict[str, int]:
        return {n: Net.sent(ns, i) for n, (ns, _, i) in self.nodes.items()}

    def fetch_seconds(self, names: list[str], digest: str) -> str:
        """Each receiver's own fetch time (its agent's bytes over rate), without fleet's planning."""
        out = []
        for n in names:
            job = httpx.get(f"{self.url(n)}/v1/weights/{digest}", headers=AUTH, timeout=30).json().get("fetch") or {}
            rate = job.get("rate_bytes_per_s") or 0
            out.append(f"{n} {job.get('bytes_fetched', 0) / rate:.2f}" if rate else f"{n} ?")
        return "  ".join(out)

    def delete(self, names: list[str], digest: str) -> None:
        for n in names:
            httpx.delete(f"{self.url(n)}/v1/weights/{digest}", headers=AUTH, timeout=30)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def fleet_file(path: Path, agents: Agents, digest: str, receivers: list[str]) -> None:
    nodes = "\n".join(f"  {n}: {{address: {a}, agent_port: {PORT}}}" for n, (_, a, _) in agents.nodes.items())
    path.write_text(f"version: 1\ncontrol_plane: {{node: src}}\nnodes:\n{nodes}\nmodels:\n"
                    f"  m: {{format: gguf, digest: \"{digest}\", source: src}}\n"
                    f"replicas:\n  m: [{', '.join(receivers) or 'src'}]\nclusters: {{}}\n")


def apply(root: Path, agents: Agents, digest: str, receivers: list[str]) -> tuple[float, str]:
    """fleet apply of `receivers` holding the model: seconds, and the plan it printed."""
    fleet_file(root / "fleet.yaml", agents, digest, receivers)
    began = time.monotonic()
    done = subprocess.run([fleet_bin(), "apply", "--auto-approve", "-f", str(root / "fleet.yaml")],
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL,
                          env=agent_env(FLEET_STATE_DIR=str(root / "state")))
    took = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(f"fleet apply failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return took, done.stdout


def drive(agents: Agents, digest: str, peers: dict[str, str]) -> float:
    """Each receiver fetches from its peer through the agents' API, as soon as that peer holds the
    model (the source holds it from the start); seconds until all hold it."""
    began = time.monotonic()
    holding, asked = {"src"}, set()
    deadline = began + 900
    while len(holding) < len(peers) + 1 and time.monotonic() < deadline:
        for n, peer in peers.items():
            if n not in asked and peer in holding:
                r = httpx.put(f"{agents.url(n)}/v1/weights/{digest}", headers=AUTH, timeout=30,
                              json={"peer": agents.url(peer), "name": "m"})
                r.raise_for_status()
                asked.add(n)
        for n in sorted(asked - holding):
            state = httpx.get(f"{agents.url(n)}/v1/weights/{digest}", headers=AUTH, timeout=30).json()
            if state["state"] == "present":
                holding.add(n)
            elif state["state"] == "failed":
                raise SystemExit(f"{n}: {state}")
        time.sleep(0.05)
    if len(holding) < len(peers) + 1:
        raise SystemExit(f"still fetching after 900 s: {sorted(set(peers) - holding)}")
    return time.monotonic() - began


def tree(receivers: list[str]) -> dict[str, str]:
    """fleet's arrangement before chains: every holder serves two whole copies, log2 rounds."""
    peers = ["src"] + receivers
    return {n: peers[i // 2] for i, n in enumerate(receivers)}


def busy(cpu: float, seconds: float) -> str:
    return f"agents' CPU {cpu:5.1f} s, {cpu / seconds:.2f} of {os.cpu_count()} cores busy on average"


def fresh_writes(root: Path, size: int) -> str:
    """CPU seconds per GiB of a plain write of `size` bytes into a tmpfs of small pages (as the
    agents' homes) and into one of huge pages, whose 2 MiB blocks are the free memory a VM's host
    takes back (free page reporting): the warm and the cold price of a page on this machine."""
    buf = memoryview(bytearray(os.urandom(1 << 20)))
    out = []
    for label, options in (("small pages", "size={},huge=never"), ("huge pages", "size={},huge=always")):
        mount = root / f"fresh-{label.split()[0]}"
        mount.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options.format(size + (64 << 20)), "tmpfs", str(mount)],
                          capture_output=True).returncode != 0:
            out.append(f"{label} ? (mount refused)")
            continue
        try:
            began = time.thread_time()
            with open(mount / "x", "wb", buffering=0) as fh:
                for _ in range(size >> 20):
                    fh.write(buf)
            out.append(f"{label} {(time.thread_time() - began) / (size / 2**30):.2f}")
        finally:
            sh("umount", "-l", str(mount), check=False)
    return ", ".join(out)


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {n: after[n] - before[n] for n in after}


def links(sent: dict[str, int], size: int) -> str:
    return "  ".join(f"{n} {b / size:.2f}" for n, b in sent.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--receivers", type=int, default=8)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--piece-size", default="auto",
                    help="the model's pieces (fleet-agent import --piece-size; auto: by the file's size, "
                         "4MiB for 1 GiB): each hop of a chain adds one")
    ap.add_argument("--queue-ms", type=float, default=2.0, help="tbf's queue, in ms of the rate (default: 2.0)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="fan-outs in a row (default 3): the ratio is the median of all but the first, which "
                         "writes into memory this VM's host may have taken back (docs/ARCHITECTURE.md); every "
                         "round's is printed")
    ap.add_argument("--no-baselines", action="store_true",
                    help="one node and the fan-out only (the ratio): no tree, no everyone-from-the-source")
    ap.add_argument("--fresh-memory", action="store_true",
                    help="first, a plain write of the model's size into fresh small and huge tmpfs pages")
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("bench/fanout: --rounds is at least 1")
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit("bench/fanout needs root and iproute2 (ip, tc)")
    cleanup(stale_mounts())
    size = int(args.gib * (1 << 30)) // (1 << 20) << 20
    avail = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))) * 1024
    copies = args.receivers + 1
    if avail < copies * size + (4 << 30) and size > 512 << 20:
        print(f"MemAvailable {avail / 2**30:.1f} GiB cannot hold {copies} copies of {size / 2**30:.2f} GiB and "
              "leave 4 GiB: 512 MiB instead", flush=True)
        size = 512 << 20
    root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={copies * size + (1 << 30)}", "tmpfs", str(root)],
                             capture_output=True).returncode == 0
    agents = Agents(root)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; homes on "
          f"{'a tmpfs' if mounted else 'disk (tmpfs mount refused)'}; {args.receivers} receivers, {args.rate} egress "
          f"each (tbf, queue {args.queue_ms:g} ms), model {size / 2**20:.0f} MiB in pieces of {args.piece_size}", flush=True)
    try:
        if mounted and args.fresh_memory:
            print(f"a plain write into fresh memory, CPU-s per GiB: {fresh_writes(root, size)}", flush=True)
        net = Net(args.rate, args.queue_ms)
        names = ["src"] + [f"n{i}" for i in range(1, args.receivers + 1)]
        for i, name in enumerate(names):
            agents.start(name, *net.add(i), i)
        agents.wait_up()
        model = root / "m.gguf"
        make_file(model, size)
        imported = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(root / "src"), str(model),
                                   "--json", "--link", "--piece-size", args.piece_size], capture_output=True, text=True, timeout=600, env=agent_env(),
                                  check=True)
        digest = json.loads(imported.stdout)["digest"]
        receivers = names[1:]

        before, cpu = agents.sent(), agents.cpu()
        one, _ = apply(root, agents, digest, receivers[:1])
        one_links = delta(before, agents.sent())
        print(f"one node (fleet apply, src -> n1): {one:6.2f} s  {size / one / 1e6:6.1f} MB/s; the fetch itself: "
              f"{agents.fetch_seconds(receivers[:1], digest)} s; {busy(agents.cpu() - cpu, one)}", flush=True)
        agents.delete(receivers[:1], digest)

        rounds: list[float] = []
        for r in range(1, args.rounds + 1):
            before, (user, system) = agents.sent(), agents.cpu_split()
            fan, plan = apply(root, agents, digest, receivers)
            after = agents.cpu_split()
            fan_links, fan_cpu = delta(before, agents.sent()), sum(after) - user - system
            rounds.append(fan)
            chain = [line.strip() for line in plan.splitlines() if "fetch" in line and "bytes from" in line]
            print(f"fan-out round {r} (fleet apply, {len(receivers)} receivers): {fan:6.2f} s, "
                  f"{fan / one:.2f} x one node; plan: " + "; ".join(c.split("bytes from ")[-1] for c in chain),
                  flush=True)
            print(f"  each fetch itself (s): {agents.fetch_seconds(receivers, digest)}; {busy(fan_cpu, fan)} "
                  f"(user {after[0] - user:.1f}, kernel {after[1] - system:.1f}; "
                  f"{fan_cpu / len(receivers) / (size / 2**30):.2f} CPU-s per GiB received)", flush=True)
            agents.delete(receivers, digest)
        which = ("one round" if len(rounds) == 1 else "round 2" if len(rounds) == 2
                 else f"the median of rounds 2-{len(rounds)}")
        ratio = (f"ratio fan-out / one node: {statistics.median(rounds[1:] or rounds) / one:.2f} (target <= 1.3; "
                 f"{which}; every round: {', '.join(f'{x / one:.2f}' for x in rounds)})")
        if args.no_baselines:
            print(ratio)
            print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
            return

        before, cpu = agents.sent(), agents.cpu()
        tree_s = drive(agents, digest, tree(receivers))
        tree_links = delta(before, agents.sent())
        print(f"tree (API, each holder serving two whole copies, as fleet planned before chains): {tree_s:6.2f} s; "
              f"{busy(agents.cpu() - cpu, tree_s)}", flush=True)
        agents.delete(receivers, digest)

        before, cpu = agents.sent(), agents.cpu()
        everyone = drive(agents, digest, {n: "src" for n in receivers})
        src_links = delta(before, agents.sent())
        print(f"everyone from the source (API, {len(receivers)} at once): {everyone:6.2f} s; "
              f"{busy(agents.cpu() - cpu, everyone)}", flush=True)
        print(f"  each fetch itself (s): {agents.fetch_seconds(receivers, digest)}", flush=True)
        print(f"bytes sent per link, in copies of the model ({size:,} bytes):")
        print(f"  one node:    {links(one_links, size)}")
        print(f"  fan-out:     {links(fan_links, size)}")
        print(f"  tree:        {links(tree_links, size)}")
        print(f"  from source: {links(src_links, size)}")
        print(f"{ratio}; tree / one node: {tree_s / one:.2f}; everyone-from-source / one node: {everyone / one:.2f}")
        print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        agents.stop()
        cleanup([root] if mounted else [])
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
