"""The commands that belong to no role: `swarm local` (the single-process reference), `swarm
broker` (the embedded MQTT broker) and `swarm prepare-data` (text files into a token file).
`swarm.cli` loads this module as it loads a role's."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from swarm.errors import SwarmError
from swarm.flags import add_flag, add_token, token

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
        add_flag(p, "threads", 0, "torch threads (0: one per core)", type=int)
        p.add_argument("--log", type=Path, help="write one JSON line per step here")
    elif command == "prepare-data":
        p.add_argument("files", type=Path, nargs="+", help="UTF-8 text files, in order")
        p.add_argument("--out", type=Path, required=True, help="the token file to write")
        p.add_argument(
            "--tokenizer",
            type=Path,
            help="a Hugging Face tokenizers file (tokenizer.json); without it the bytes are "
            "the tokens (vocabulary 256)",
        )
    elif command == "broker":
        add_flag(p, "host", "127.0.0.1", "address to listen on")
        add_flag(p, "port", 1883, "port", type=int)
        add_token(p)


def run(command: str, args: argparse.Namespace) -> int:
    if command == "prepare-data":
        return _prepare_data(args)
    return _local(args) if command == "local" else _broker(args)


def _prepare_data(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from swarm.prepare import prepare_data

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


def _local(args: argparse.Namespace) -> int:
    import torch

    from swarm.config import load_job
    from swarm.progress import StepLog
    from swarm.reference import train_local

    job = load_job(args.job_file)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    with StepLog(job.training.steps, path=args.log, desc=f"local {job.name}") as steps:
        model = train_local(job, args.device, on_step=steps)
    if args.out:
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        if args.format == "hf":
            from swarm.hf import write_hf

            write_hf(args.out, state, job.model, None)
        else:
            torch.save(state, args.out)
        print(f"wrote {args.out}")
    return 0


def _broker(args: argparse.Namespace) -> int:
    from swarm.broker import run_broker
    from swarm.lifecycle import install_signal_handlers

    async def serve() -> None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
        await run_broker(args.host, args.port, token(args), stop)

    asyncio.run(serve())
    return 0
