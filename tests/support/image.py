"""The container image, built as `make image` builds it and as the container tests need it, on a
host where no image registry is reachable: podman (with runc and cgroupfs: `containers.conf`),
a base image made from Debian packages by mmdebstrap, and pip inside the build reaching the
package index the way this host's pip does (its settings and local wheel folders passed on).

    .venv/bin/python -m tests.support.image [--tag swarm:latest] [--base IMAGE]
    .venv/bin/python -m tests.support.image --tag swarm:test --target test --run   # make image-test

Without `--base`, the base is `localhost/swarm-base:bookworm`, made once (python3 and its venv
module from Debian's packages) and reused."""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from tests.support.cli import ROOT

__all__ = ["BASE", "Unavailable", "build", "ensure_podman", "pip_settings", "podman", "podman_env"]

BASE = "localhost/swarm-base:bookworm"
RELEASE = "bookworm"
PACKAGES = ("podman", "runc", "mmdebstrap", "uidmap")
PIP_SETTINGS = ("index-url", "extra-index-url", "find-links", "constraint", "cert", "trusted-host")


class Unavailable(Exception):
    """Containers cannot run on this host at all (not root, no podman to be had)."""


def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(ROOT / "containers.conf")}


def podman(
    *args: str, check: bool = True, timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["podman", *args], capture_output=True, text=True, env=podman_env(), timeout=timeout
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}: exit {done.returncode}\n{done.stderr}")
    return done


def ensure_podman() -> None:
    """podman, runc and mmdebstrap, installed from Debian's packages when missing (as `make test`
    installs Mosquitto); `Unavailable` where that cannot be."""
    if all(shutil.which(tool) for tool in ("podman", "runc", "mmdebstrap")):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise Unavailable("podman, runc and mmdebstrap are missing and this is no root Debian")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            raise Unavailable(f"{' '.join(argv)} failed: {done.stderr[-500:]}")


def base_image() -> str:
    """`BASE`, made by mmdebstrap and imported the first time."""
    if podman("image", "exists", BASE, check=False).returncode == 0:
        return BASE
    with tempfile.TemporaryDirectory(prefix="swarm-base-") as work:
        tar = Path(work) / "base.tar"
        include = "--include=python3,python3-venv,ca-certificates"
        argv = ["mmdebstrap", "--variant=apt", include, RELEASE, str(tar)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise RuntimeError(f"mmdebstrap failed:\n{done.stderr[-3000:]}")
        podman("import", str(tar), BASE)
    return BASE


def pip_settings() -> dict[str, str]:
    """This host's pip settings (`pip config list`, then PIP_* variables), by setting name, each
    one's values on one line, apart by spaces (as pip reads several)."""
    found: dict[str, str] = {}
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        name = key.rpartition(".")[2]
        if name in PIP_SETTINGS:
            # printed as Python's repr: a value of several lines holds "\n"s, not line breaks
            found[name] = " ".join(str(ast.literal_eval(value.strip())).split())
    for name in PIP_SETTINGS:
        value = os.environ.get("PIP_" + name.upper().replace("-", "_"))
        if value:
            found[name] = " ".join(value.split())
    return found


def _local_paths(value: str) -> list[Path]:
    """The host's own files and folders a pip setting names (paths, file:// URLs). An index's
    pages (`.../simple`) link to its files beside them: its parent folder is named."""
    paths = []
    for word in value.split():
        path = Path(urlsplit(word).path) if word.startswith("file://") else Path(word)
        if word.startswith("file://") and path.name == "simple":
            path = path.parent
        if path.is_absolute() and path.exists():
            paths.append(path)
    return paths


def pip_passthrough(work: Path) -> list[str]:
    """`podman build` arguments that give pip inside the build this host's settings: a pip.conf
    written under `work`, passed as the build secret the Containerfile's pip steps mount (in no
    layer and no history, where build arguments would be in the history of the image every role
    runs), and the local folders and files those settings name, mounted read-only at the same
    paths."""
    settings = sorted(pip_settings().items())
    conf = work / "pip.conf"
    conf.write_text("[global]\n" + "".join(f"{name} = {value}\n" for name, value in settings))
    args = ["--secret", f"id=pip.conf,src={conf}"]
    mounts = {path for _, value in settings for path in _local_paths(value)}
    for path in sorted(mounts):
        args += ["--volume", f"{path}:{path}:ro"]
    return args


def build(tag: str, base: str | None = None, target: str | None = None) -> float:
    """Build the Containerfile into `tag` (pip as on this host: torch from pip's own index, as
    `make install` takes it); `target`: a stage of it (`test`: the image with the fast tests),
    else the image every role runs. The seconds it took."""
    started = time.monotonic()
    argv = ["build", "--format", "docker", "--network", "host", "-f", "Containerfile", "-t", tag]
    argv += ["--target", target] if target else []
    argv += ["--build-arg", f"BASE={base or base_image()}", "--build-arg", "TORCH_INDEX="]
    with tempfile.TemporaryDirectory(prefix="swarm-pip-") as work:
        podman(*argv, *pip_passthrough(Path(work)), str(ROOT), timeout=1800)
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="swarm:latest")
    parser.add_argument("--base", help=f"the base image (default: {BASE}, made by mmdebstrap)")
    parser.add_argument("--target", help="a stage of the Containerfile (test: with the fast tests)")
    parser.add_argument("--run", action="store_true", help="then run it (its tests, with test)")
    args = parser.parse_args()
    try:
        ensure_podman()
    except Unavailable as e:
        print(f"swarm image: {e}", file=sys.stderr)
        return 2
    seconds = build(args.tag, args.base, args.target)
    size = podman("image", "inspect", "--format", "{{.Size}}", args.tag).stdout.strip()
    print(f"built {args.tag} in {seconds:.0f} s: {int(size) / 1e9:.2f} GB", flush=True)
    if args.run:
        argv = ["podman", "run", "--rm", "--network", "host", "--ulimit", "host", args.tag]
        return subprocess.run(argv, env=podman_env()).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
