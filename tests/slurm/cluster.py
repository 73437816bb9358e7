"""A real two-node SLURM cluster on this host, for tests (and by hand: ``python tests/slurm/cluster.py``).

slurmctld plus two ``slurmd -N`` daemons (nodes n1, n2, one CPU each) and a private munged, all with state, logs,
sockets and pid files in one temp folder and their own free ports. Facts it relies on: shared/notes of the
project (multiple-slurmd support in Debian's slurm-wlm, config_overrides, cred_expire). ``stop()`` kills only the
daemons this cluster started, by the pids in their pid files, munged last.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

NEEDED = ("sbatch", "slurmctld", "slurmd", "munged", "scontrol", "sinfo", "squeue")


def ensure_installed() -> str | None:
    """Installs Debian's slurm-wlm and munge when missing; returns why it cannot, or None."""
    if all(shutil.which(t) or Path("/usr/sbin", t).exists() for t in NEEDED):
        return None
    if not shutil.which("apt-get"):
        return "SLURM is not installed and apt-get is unavailable to install slurm-wlm and munge"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "slurm-wlm", "munge"]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode:
            return f"{' '.join(cmd)} failed: {r.stderr[-500:]}"
    return None


def _free_port_pair() -> int:
    """A port p with p and p + 1 both free (slurmd ports of n1 and n2)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no pair of free ports")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="titan_slurm_"))
        self.dir.chmod(0o700)
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.started: list[Path] = []  # pid files of the daemons we started, in start order

    def _sbin(self, name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def start(self, timeout: float = 60) -> "Cluster":
        d, host = self.dir, socket.gethostname()
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = d / "munge.socket"
        subprocess.run([self._sbin("munged"), f"--key-file={key}", f"--socket={sock}", f"--pid-file={d}/munged.pid",
                        f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed", "--force"], check=True)
        self.started.append(d / "munged.pid")
        p = _free_port_pair()
        (d / "state").mkdir()
        self.conf.write_text(f"""ClusterName=titan
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmdParameters=config_overrides
SchedulerParameters=sched_interval=2,bf_interval=1
MinJobAge=600
ReturnToService=2
NodeName=n[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port={p}-{p + 1} CPUs=1 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
""")
        subprocess.run([self._sbin("slurmctld"), "-f", str(self.conf)], check=True, env=self.env)
        self.started.append(d / "slurmctld.pid")
        for node in ("n1", "n2"):
            subprocess.run([self._sbin("slurmd"), "-f", str(self.conf), "-N", node], check=True, env=self.env)
            self.started.append(d / f"slurmd-{node}.pid")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if states.get("n1") == "idle" and states.get("n2") == "idle":
                return self
            time.sleep(0.3)
        raise RuntimeError(f"the cluster did not come up: {r.stdout} {r.stderr}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"== {f.name}\n{f.read_text()[-2000:]}" for f in sorted(self.dir.glob("*.log")))

    def sbatch(self, *args: str, cwd: Path, env: dict | None = None) -> str:
        r = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env={**self.env, **(env or {})},
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"sbatch failed: {r.stderr}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        r = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=self.env, capture_output=True, text=True)
        return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)

    def wait(self, job_id: str, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
             timeout: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s")

    def stop(self) -> None:
        """Stops the daemons this cluster started (newest first, munged last), by pid; removes the folder."""
        for pid_file in reversed(self.started):
            try:
                pid = int(pid_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.dir, ignore_errors=True)


if __name__ == "__main__":
    why = ensure_installed()
    if why:
        raise SystemExit(why)
    c = Cluster().start()
    print(f"cluster up: SLURM_CONF={c.conf}; press Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
