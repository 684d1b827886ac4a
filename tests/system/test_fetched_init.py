"""A friend's machines start a fine-tuning job with nothing but the invite (issue 68 item 9): a
public host runs the scheduler with TLS (its embedded broker `mqtts://`, its trainer) and a relay;
the job starts from a Hugging Face checkpoint (`[model] init_from`) under the scheduler's data
root. The friend's two machines sit behind a NAT router (`swarm.local.nat`) and run `swarm
stage-server --join alice.invite.json` (and `--peer gpu1.alice`), each in a mount namespace of its
own with a tmpfs over the data root: another machine, as far as files go. Each loads its stage's
slice of the checkpoint, which it fetches from the scheduler (`FetchInit`, with the invite's
token, through the NAT) into its own cache by the pin, and the job ends float64-equal to `swarm
local` from the same checkpoint. Before, each refused the job at once: it measures its stages by
building them, and the checkpoint's directory was not there ("cannot read model.safetensors").

Needs root, unshare(1) and nftables (CI has all three)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from swarm.job.config import load_job
from swarm.local import netns
from swarm.net.certs import init_ca, issue
from tests.support import namespaces
from tests.support.equality import assert_equal_to_local
from tests.support.pretrained import write_finetune, write_pretrained

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]

ROOT = namespaces.ROOT
PREFIX = "swf-"
HUB = "10.91.0.10"  # the public host: the scheduler, its broker, the relay
HOME = netns.Lan("gw", "10.91.0.2", "192.168.91.0/24", {"a": "192.168.91.10", "b": "192.168.91.11"})
PEERS = {"a": "alice", "b": "gpu1.alice"}  # one invite, two machines
SCHEDULER = f"{HUB}:7700"
TOKEN = "fetched-init-token"
_swarm = namespaces.swarm_argv
# A mount namespace of its own with a tmpfs over the directory "$0", then the command: the
# process sees that directory empty, whatever the test's machine holds there.
_HIDE = 'mount -t tmpfs tmpfs "$0" && exec "$@"'


class _Swarm:
    """The public host's processes and the friend's stage servers, each with its log."""

    def __init__(self, lab: netns.Network, work: Path) -> None:
        self.lab, self.work = lab, work
        certs = work / "certs"
        init_ca(certs)
        issue(certs, "scheduler", [HUB])
        self.hub_env = namespaces.swarm_env(
            TOKEN,
            work / "cache-hub",
            SWARM_TLS_CA=str(certs / "ca.pem"),
            SWARM_TLS_CERT=str(certs / "scheduler.pem"),
            SWARM_TLS_KEY=str(certs / "scheduler.key"),
        )
        self.procs: list[netns.Proc] = []
        self.deadline = time.monotonic() + 360

    def start(self, host: str, name: str, env: dict[str, str], argv: list[str]) -> netns.Proc:
        self.procs.append(self.lab.start(host, name, argv, self.work, env, ROOT))
        return self.procs[-1]

    def on_hub(self, *args: str) -> str:
        return namespaces.run_on(self.lab, "hub", _swarm(*args), self.hub_env)

    def up(self, data: Path) -> dict[str, netns.Proc]:
        """The scheduler (data root `data`), the relay, the invite; the friend's stage servers,
        which see `data` empty."""
        args = namespaces.scheduler_args(HUB, self.work, data)
        broker = self.start("hub", "scheduler", self.hub_env, _swarm(*args))
        url = broker.wait_ready(self.deadline)["broker"]
        relay = ("--host", "0.0.0.0", "--port", "7100", "--announce-host", HUB)
        self.start("hub", "relay", self.hub_env, _swarm("relay", "--broker", url, *relay))
        self.procs[-1].wait_ready(self.deadline)
        invite = self.work / "alice.invite.json"
        where = ("--broker", url, "--scheduler", SCHEDULER, "--out", str(invite))
        self.on_hub("invite", "alice", "--ca-dir", str(self.work / "certs"), *where)
        friends = {}
        for host, peer in PEERS.items():
            more = ("--peer", peer) if peer != "alice" else ()
            argv = _swarm("stage-server", "--join", str(invite), "--device", "cpu", *more)
            hidden = ["unshare", "--mount", "--propagation", "private", "sh", "-c", _HIDE]
            env = namespaces.host_env(self.work, host)
            friends[host] = self.start(host, host, env, [*hidden, str(data), *argv])
        for proc in friends.values():
            proc.wait_ready(self.deadline)
        return friends

    def story(self) -> str:
        return "\n".join(f"{p.name}:\n{p.log()[-3000:]}" for p in self.procs)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.kill()
        assert not [p.name for p in self.procs if "Traceback" in p.log()], self.story()


def test_a_friends_machines_fine_tune_from_a_checkpoint_with_only_the_invite(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"  # the scheduler's data root: the checkpoint and the job file
    data.mkdir()
    write_pretrained(data)
    job = write_finetune(data, stages=2, steps=3, checkpoint_every=0)
    pin = load_job(job).model.init_sha256
    with namespaces.network(PREFIX, {"hub": HUB}, [HOME]) as lab:
        swarm = _Swarm(lab, tmp_path)
        try:
            friends = swarm.up(data)
            job_id = swarm.on_hub("submit", str(job), "--scheduler", SCHEDULER).split()[0]
            looker = namespaces.Looker(lab, "hub", SCHEDULER, swarm.hub_env)
            try:
                state = ""
                while state not in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED"):
                    assert time.monotonic() < swarm.deadline, swarm.story()
                    refused = [h for h, p in friends.items() if "refused job" in p.log()]
                    assert not refused, swarm.story()  # on the old code: no checkpoint here
                    state = looker.look(job_id)["state"]
                    time.sleep(0.5)
            finally:
                looker.close()
            assert state == "JOB_STATE_SUCCEEDED", swarm.story()
            out = tmp_path / "swarm.pt"
            swarm.on_hub("export", job_id, "--out", str(out), "--scheduler", SCHEDULER)
        finally:
            swarm.stop()
        logs = {h: p.log() for h, p in friends.items()}
    for host, said in logs.items():  # each fetched it, as the directory was not there
        assert "model.init_from" in said and "fetching it from the scheduler" in said, said[-3000:]
        kept = tmp_path / f"cache-{host}" / "init" / str(pin)
        assert sorted(p.name for p in kept.iterdir()) == ["config.json", "model.safetensors"]
    assert_equal_to_local(job, torch.load(out), tol=1e-9)  # from the same checkpoint
