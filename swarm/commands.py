"""The commands that belong to no role: `swarm local` (the single-process reference), `swarm
broker` (the embedded MQTT broker), `swarm prepare-data` (text files into a token file) and `swarm
generate` (text sampled from a trained model).
`swarm.cli` loads this module as it loads a role's."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from swarm.bus.flags import add_login_flags, scheduler_token
from swarm.errors import SwarmError
from swarm.flags import add_flag, add_token, at_least, token
from swarm.net.paths import PEER_DOMAIN
from swarm.net.tls import add_tls_flags

if TYPE_CHECKING:  # imported where used: `swarm --help` and the bus tools take no torch
    import torch

    from swarm.job.config import JobConfig

__all__ = ["add_arguments", "run"]


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    if command == "local":
        p.add_argument("job_file", type=Path, help="job file (TOML)")
        p.add_argument("--out", type=Path, help="write the trained model's state_dict here")
        p.add_argument(
            "--format",
            choices=("torch", "hf"),
            default="torch",
            help="--out as a torch state_dict, or a Hugging Face checkpoint directory",
        )
        add_flag(p, "device", "cpu", "torch device: cpu, cuda:N, mps")
        add_flag(p, "threads", 0, "torch threads (0: one per core)", type=at_least(0))
        p.add_argument("--log", type=Path, help="write one JSON line per step here")
        p.add_argument(
            "--replicas",
            type=int,
            help='pool.mode = "local": replicas of every stage, a synthetic wiring (default 2)',
        )
        p.add_argument(
            "--routes",
            type=Path,
            help='pool.mode = "local": replay this route record (the swarm\'s) instead',
        )
    elif command == "prepare-data":
        p.add_argument("files", type=Path, nargs="+", help="UTF-8 text files, in order")
        p.add_argument("--out", type=Path, required=True, help="the token file to write")
        p.add_argument(
            "--tokenizer",
            type=Path,
            help="a Hugging Face tokenizers file (tokenizer.json); without it the bytes are "
            "the tokens (vocabulary 256)",
        )
    elif command == "certs":
        p.add_argument("action", choices=("init", "issue"), help="init: a new CA; issue: a cert")
        p.add_argument(
            "name", nargs="?", help="issue: the certificate's name (files NAME.pem/.key)"
        )
        p.add_argument(
            "--host",
            action="append",
            default=[],
            help="issue: a DNS name or IP address others dial it by, as it announces it "
            "(--announce-host; repeat for more)",
        )
        p.add_argument(
            "--peer",
            action="append",
            default=[],
            help="issue: a peer id it serves as (its --peer). A stage server behind NAT needs "
            "one: callers reach it through a relay and verify it by its peer id (as "
            f"ID.{PEER_DOMAIN}), not by its private address",
        )
        p.add_argument("--dir", type=Path, default=Path("certs"), help="where the CA lives")
        p.add_argument("--days", type=int, help="validity (default: CA 3650, host 365)")
    elif command == "generate":
        p.add_argument(
            "model",
            type=Path,
            help="a Hugging Face checkpoint directory (swarm export --format hf)",
        )
        p.add_argument("--prompt", required=True, help="the text to continue")
        p.add_argument("--tokens", type=int, default=200, help="tokens to sample")
        p.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest")
        p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0: all)")
        p.add_argument("--seed", type=int, default=0, help="sampling seed")
        p.add_argument(
            "--tokenizer",
            type=Path,
            help="the tokenizers file the data was prepared with; without it, bytes",
        )
        add_flag(p, "device", "cpu", "torch device: cpu, cuda:N, mps")
    elif command == "broker":
        add_flag(p, "host", "127.0.0.1", "address to listen on")
        add_flag(p, "port", 1883, "port to listen on", env="broker-port", type=int)
        add_token(p)
        add_login_flags(p)
        add_tls_flags(p)


def run(command: str, args: argparse.Namespace) -> int:
    if command == "prepare-data":
        return _prepare_data(args)
    if command == "generate":
        return _generate(args)
    if command == "certs":
        return _certs(args)
    return _local(args) if command == "local" else _broker(args)


def _prepare_data(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from swarm.model.prepare import prepare_data

    total = sum(f.stat().st_size for f in args.files if f.is_file())
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="prepare-data") as bar:
            done = prepare_data(args.files, args.out, args.tokenizer, on_bytes=bar.update)
    except OSError as e:  # a full disk, say: nothing partial is left behind
        raise SwarmError(f"cannot write {args.out}: {e.strerror or e}") from None
    bits = 8 * done.width
    print(
        f"wrote {done.path}: {done.tokens} tokens as uint{bits} (vocabulary {done.vocab_size}), "
        f"sha256 {done.sha256}\n"
        f'use it with [data] kind = "tokens", path = "{done.path}" and [model] vocab_size >= '
        f"{done.vocab_size}" + (" (and <= 65536: the ids are 16-bit)" if done.width == 2 else "")
    )
    return 0


def _certs(args: argparse.Namespace) -> int:
    from swarm.net.certs import init_ca, issue
    from swarm.net.paths import peer_name

    if args.days is not None and args.days < 1:
        raise SwarmError(f"--days must be >= 1, got {args.days}")
    if args.action == "init":
        done = init_ca(args.dir, args.days or 3650)
        print(
            f"wrote {done.cert} (give it to every process: --tls-ca) and {done.key} (keep it "
            f"private), valid until {done.not_after:%Y-%m-%d}"
        )
        return 0
    if not args.name:
        raise SwarmError("certs issue needs a NAME (its files are NAME.pem and NAME.key)")
    done = issue(args.dir, args.name, args.host, args.days or 365, peers=args.peer)
    named = [*args.host, *(f"peer {p} ({peer_name(p)})" for p in args.peer)]
    print(
        f"wrote {done.cert} and {done.key} for {', '.join(named)}, valid until "
        f"{done.not_after:%Y-%m-%d}: --tls-cert {done.cert} --tls-key {done.key}"
        + "".join(f" --peer {p}" for p in args.peer)
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from swarm.device.facts import TorchFacts, resolve_device
    from swarm.model.generate import from_hf, generate, load_hf, text_codec

    if args.tokens < 0:
        raise SwarmError(f"--tokens must be >= 0, got {args.tokens}")
    cfg, codec = from_hf(args.model), text_codec(args.tokenizer)
    if codec.vocab_size > cfg.vocab_size:
        raise SwarmError(
            f"the model knows {cfg.vocab_size} tokens, the tokenizer makes {codec.vocab_size}: "
            "give the --tokenizer its data was prepared with (none for bytes)"
        )
    facts = TorchFacts()  # a device this machine lacks: said as `swarm local` says it
    model = load_hf(args.model, resolve_device(args.device, facts))
    ids = generate(
        model,
        codec.encode(args.prompt),
        seq_len=cfg.seq_len,
        tokens=args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(args.prompt + codec.decode(ids))
    return 0


def _local(args: argparse.Namespace) -> int:
    import torch

    from swarm.device.facts import TorchFacts, resolve_device, use_device
    from swarm.job.config import load_job
    from swarm.model.data import check_token_ids
    from swarm.model.hf import check_out, check_writable, write_hf
    from swarm.model.local_steps import simulates_replicas
    from swarm.ops.model_out import ModelOut, writable

    facts = TorchFacts()  # the device checked first, as a stage server's: a clear error, no cuda:0
    use_device(device := resolve_device(args.device, facts), facts)
    job = load_job(args.job_file)
    check_token_ids(job)  # before it trains, not at the step that draws one
    local_steps = simulates_replicas(job)
    if not local_steps and (args.replicas is not None or args.routes is not None):
        raise SwarmError(
            '--replicas and --routes need a job with pool.mode = "local" (or delayed_update '
            'with pool.overlap = "eager")'
        )
    if args.replicas is not None and args.routes is not None:
        raise SwarmError("give --replicas or --routes, not both: the record names its replicas")
    if args.routes is not None:  # read as the steps come: a file it cannot open said first
        try:
            Path(args.routes).open("rb").close()
        except OSError as e:
            raise SwarmError(f"--routes {args.routes}: cannot read it ({e.strerror})") from None
    # What it writes, opened before it trains (`swarm.ops.model_out`)
    if args.log is not None:
        writable("--log", Path(args.log), "a").close()
    hf, out = args.format == "hf", None if args.out is None else Path(args.out)
    if out is not None and hf:
        try:
            check_out(out, job.model)
            check_writable(out)
        except OSError as e:  # exists and not empty, or a directory it cannot write in
            raise SwarmError(f"--out {out}: {getattr(e, 'strerror', None) or e}") from None
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    with contextlib.ExitStack() as stack:
        model_out = None if out is None or hf else stack.enter_context(ModelOut("--out", out))
        model = _trained(args, job, device, local_steps)
        if out is not None:
            state = {k: v.cpu() for k, v in model.state_dict().items()}
            if model_out is not None:
                model_out.write(state)
            else:
                from swarm.model.transformer import plain_state

                try:
                    write_hf(out, *plain_state(job, state), None)
                except OSError as e:  # a full disk: said in one line (nothing is left of it)
                    raise SwarmError(f"--out {out}: cannot write it ({e.strerror or e})") from None
            print(f"wrote {out}")
    return 0


def _trained(
    args: argparse.Namespace, job: JobConfig, device: torch.device, local_steps: bool
) -> torch.nn.Module:
    """`swarm local`'s training, logged as it goes."""
    from swarm.model.reference import train_local
    from swarm.ops.progress import StepLog

    with StepLog(job.training.steps, path=args.log, desc=f"local {job.name}") as steps:
        if local_steps:
            from swarm.model.local_steps import train_replicas
            from swarm.model.routes import read_routes

            routes = read_routes(args.routes) if args.routes is not None else None
            return train_replicas(job, device, replicas=args.replicas, routes=routes, on_step=steps)
        return train_local(job, device, on_step=steps)


def _broker(args: argparse.Namespace) -> int:
    from swarm.bus.broker import run_broker
    from swarm.ops.lifecycle import install_signal_handlers

    async def serve() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await run_broker(
            args.host,
            args.port,
            token(args),
            stop,
            scheduler_token=scheduler_token(args),
            use_identity_as_username=args.use_identity_as_username,
        )

    asyncio.run(serve())
    return 0
