"""The client's commands on the command line: `swarm submit|status|jobs|cancel|delete|export` (their
bodies in `client.commands`), `swarm trainer` and `swarm demo`: their flags, and which body runs."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from client.outage import WAIT_RETRY_S, WATCH_RETRY_S
from swarm.errors import SwarmError
from swarm.flags import (
    HelpFormatter,
    add_flag,
    add_metrics_token,
    add_secret,
    add_token,
    at_least,
    env_name,
    metrics_token,
    seconds,
    secret,
    token,
)
from swarm.net.invite import add_join_flag
from swarm.net.ports import Listener, PortFlag, naming
from swarm.net.tls import add_tls_flags

__all__ = ["JOB_COMMANDS", "STATUS_VIEW", "add_arguments", "run"]

JOB_COMMANDS = ("submit", "status", "jobs", "cancel", "delete", "export")  # talk to the job API
_METRICS_PORT = PortFlag(Listener.METRICS, "--metrics-port", env_name("trainer-metrics-port"))
_DEMO_JOB = Path(__file__).resolve().parent.parent / "examples" / "tiny.toml"


STATUS_VIEW = """\
what the view shows (docs/deployment.md, "Watch it", says more):
  job       the job's id (its name)
  state     queued, placing (waiting for peers), running, stalled (a stage has no replica, or
            no step commits: its message names the last failure, and it carries on by itself
            once that clears), succeeded, failed or cancelled; an ended job's: how long it took
  step      steps committed / steps the job trains
  loss      the last committed step's training loss (-: none yet)
  val loss  the last validation loss, after how many steps (jobs with a validation split)
  speed     the job's samples/s over the last 30 s (0 in a stall); an ended job's: its mean
  rounds    pools that average in rounds: the rule, the round, steps to the next average, the
            last average's time and the bytes its pools sent each other
  audits    the share of each stage's microbatches re-executed by another replica to check it
            ([trust] audit_fraction) and what that costs in stage compute; who was banned for
            lying (an audit caught them; the job rolled back and replayed without them)
  window    microbatches a trainer keeps in flight: the job's max_in_flight (fixed), or with
            "auto" what the narrowest stage's replicas hold (HOLDS; 8 where none says)
  message   what the job does or waits for now, and for how long; news (a rollback, a replica
            left out, a stage served again) for 20 steps, then "training" (events keep it)
  error     why it failed
  warning   what would cost it later (a stage without a spare, a peer nobody can dial) and the fix
  stage K (layers A-B): N replica(s)   N counts the replicas serving; then one row per peer:
    PEER       the peer's id
    DEVICE     what it computes on (cpu, cuda:0, mps)
    SAMPLES/S  its speed on this stage now: the moving average of its recent compute, from its
               load reports (the trainers' wiring weighs it by the same); before its first
               report, what it measured when it joined
    PATH       how calls reach it, as the scheduler's dial-back found: direct; via RELAY (behind
               NAT, through that relay); UNREACHABLE (why and the fix below the table); - not
               dialled back yet
    UP/DOWN    its link rates in Mbit/s, up (what it sends) / down (what it receives): the
               largest of its recent transfers of 16 MiB or more sent, 1 MiB or more received
               (rounds, state downloads, activations), or what --bandwidth says.
               ? is a direction not measured yet: ?/3140 is a peer that has received a state
               download (3140 Mbit/s down) but sent nothing that large yet; - is neither
    HOLDS      microbatches whose activations it keeps for their Backward, as its load reports
               say (its cache's bound over a microbatch's measured bytes); - not said (a CPU
               server without --max-activation-cache-bytes, the last stage, or before its
               first microbatch)
    STATE      serving (it counts), joining (not yet: with what it waits for), draining (it
               stops or moves), offline; standby for stage K, N steps behind: it follows the
               stage's updates, serves nothing, and takes the stage over if every replica is
               lost (runtime.standby); "holds no copy yet as N steps opened" until its first
               copy loads (replaced if it still holds none after 20)
  boundaries  per boundary K|K+1 between two stages, the bytes per token that crossed it as
            encoded on the wire, each way (the replicas' own counts, summed over them):
    FORWARD B/TOKEN   stage K's outputs, sent on to stage K+1 (a Push, or a Forward's reply)
    BACKWARD B/TOKEN  their gradient, sent back by stage K+1; - before a token crossed
  events    the job's history, newest last, each with its time: joins, leaves and why,
            reconnects, moves, stalls, rollbacks, its end
with --watch, "scheduler unreachable since HH:MM:SS (N s): retrying" above the last frame: the
scheduler did not answer (a network blip, a restart); the view asks again (--retry-for)
"""


class _KeptLines(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """`HelpFormatter` that keeps the epilog's lines (a table of the view) as written."""


def add_arguments(command: str, p: argparse.ArgumentParser) -> None:
    if command in JOB_COMMANDS:
        _job_command(command, p)
    elif command == "trainer":
        _trainer(p)
    elif command == "demo":
        p.add_argument("--job", type=Path, default=_DEMO_JOB, help="job file (TOML)")
        p.add_argument(
            "--chaos",
            action="store_true",
            help="keep killing random replicas (SIGKILL) and starting fresh peers",
        )


def _job_command(command: str, p: argparse.ArgumentParser) -> None:
    if command == "submit":
        p.add_argument("job_file", type=Path, help="job file (TOML)")
        p.add_argument("--wait", action="store_true", help="show progress until the job ends")
        p.add_argument("--poll", type=seconds, default=0.5, help="seconds between progress polls")
        _retry_for(p, WAIT_RETRY_S, "with --wait")
    elif command == "status":
        p.epilog, p.formatter_class = STATUS_VIEW, _KeptLines
        p.add_argument("job", help="job id (from `swarm submit` or `swarm jobs`)")
        shown = p.add_mutually_exclusive_group()
        shown.add_argument("--json", action="store_true", help="print the JobStatus as JSON")
        shown.add_argument(
            "--watch",
            action="store_true",
            help="keep the view up to date (replicas, throughput, recent events) until the job "
            "ends; exits as `submit --wait` does",
        )
        p.add_argument("--interval", type=seconds, default=1.0, help="seconds between refreshes")
        _retry_for(p, WATCH_RETRY_S, "with --watch")
    elif command in ("cancel", "delete", "export"):
        p.add_argument("job", help="job id")
    if command == "export":
        p.add_argument(
            "--out",
            type=Path,
            help="file to write (torch.save), or with --format hf a new directory",
        )
        p.add_argument(
            "--routes",
            type=Path,
            help='write the job\'s route record here (pool.mode = "local"), which `swarm local '
            "JOB.toml --routes FILE` replays",
        )
        p.add_argument(
            "--format",
            choices=("torch", "hf"),
            default="torch",
            help="torch: the state_dict; hf: model.safetensors and config.json that transformers "
            "loads (LlamaForCausalLM, GPT2LMHeadModel)",
        )
        p.add_argument(
            "--dtype",
            choices=("float32", "bfloat16", "float16"),
            help="hf: store the weights in this type (default: as trained)",
        )
    add_flag(p, "scheduler", None, "the scheduler's job API, HOST:PORT")
    add_token(p)
    add_secret(
        p,
        "submitter-token",
        "who you are to the scheduler: your submitter token (`swarm submitter-token NAME`), or "
        "its admin token; only a job's submitter or an admin may cancel, delete or export it "
        "(default: SWARM_SUBMITTER_TOKEN; none: your certificate's name under --tls-mutual, else "
        "the swarm token alone)",
    )
    add_tls_flags(p)
    add_join_flag(p)
    add_flag(p, "timeout", 30.0, "deadline per call (seconds)", type=seconds)


def _retry_for(p: argparse.ArgumentParser, default: float, view: str) -> None:
    p.add_argument(
        "--retry-for",
        type=float,
        default=default,
        metavar="SECONDS",
        help=f"{view}: how long to keep asking a scheduler that does not answer (a network "
        "blip, a restart), saying 'scheduler unreachable since ...' meanwhile, before giving up "
        "with exit 1 (inf: never; Ctrl-C stops watching, never the job)",
    )


def _trainer(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job", required=True, help="job id (with --scheduler) or job file (TOML)")
    add_flag(
        p, "scheduler", None, "the scheduler's job API, HOST:PORT (ignored with --stage-servers)"
    )
    add_flag(
        p,
        "stage-servers",
        None,
        "HOST:PORT of each stage in stage order, comma-separated; a stage's replicas "
        "separated by | (a,b|c,d: two replicas of stage 1); the trainer then drives them itself",
    )
    add_flag(
        p,
        "broker",
        None,
        "the swarm's MQTT broker (mqtt://HOST:PORT): the wiring follows the replicas' load reports",
    )
    add_token(p)
    add_secret(
        p,
        "submitter-token",
        "with --scheduler: the job's submitter's token (or the admin's credential), which makes "
        "this trainer one of the job's own, told the audits of its replicas' contributions "
        "(default: SWARM_SUBMITTER_TOKEN; none: your certificate's name under --tls-mutual, "
        "else the swarm token alone; a trainer that is not the job's own trains with those "
        "audits left out)",
    )
    add_tls_flags(p)
    add_join_flag(p)  # a friend's trainer: the job's data comes from the scheduler
    p.add_argument(
        "--out",
        type=Path,
        help="with --stage-servers: write the trained model's state_dict here (a scheduler's "
        "job: `swarm export`)",
    )
    p.add_argument(
        "--log",
        type=Path,
        help="with --stage-servers: write one JSON line per step here (a scheduler's job: "
        "`swarm status`)",
    )
    p.add_argument(
        "--checkpoint-dir",
        type=Path,
        help="with --stage-servers: write checkpoints here every "
        "training.checkpoint_every steps, and roll back to them",
    )
    p.add_argument(
        "--routes",
        type=Path,
        help='with --stage-servers and pool.mode = "local": write the route record here, '
        "which `swarm local JOB --routes FILE` replays",
    )
    add_flag(p, "threads", 1, "torch threads", type=at_least(1))
    add_flag(
        p,
        "metrics-port",
        None,
        "serve /metrics on this port (0: any free port)",
        env="trainer-metrics-port",
        type=int,
    )
    add_metrics_token(p)
    add_flag(
        p,
        "scheduler-retry-s",
        600.0,
        "with --scheduler: how long to keep asking a scheduler that does not answer (restarting, "
        "or a network outage) before giving up (seconds)",
        type=float,
    )


def run(command: str, args: argparse.Namespace) -> int:
    # Each body is imported when it runs: `swarm <command> --help` needs only the flags.
    if command in JOB_COMMANDS:
        from client.commands import (
            cmd_cancel,
            cmd_delete,
            cmd_export,
            cmd_jobs,
            cmd_status,
            cmd_submit,
        )

        body = {
            "submit": cmd_submit,
            "status": cmd_status,
            "jobs": cmd_jobs,
            "cancel": cmd_cancel,
            "delete": cmd_delete,
            "export": cmd_export,
        }[command]
        return body(args)
    if command == "trainer":
        # A port another process holds is refused before the slow start, by its flag.
        with naming("127.0.0.1", [(_METRICS_PORT, args.metrics_port)]):
            return _run_trainer(args)
    from client.demo import run_demo

    return run_demo(args.job, chaos=args.chaos)


def _run_trainer(args: argparse.Namespace) -> int:
    if args.scheduler and not args.stage_servers:
        from client.remote import run_remote_trainer

        # What only a trainer of its own stage servers writes: here it would be nothing, said
        # nowhere (a review found them taken and left unwritten).
        alone = [f for f in ("out", "log", "checkpoint_dir", "routes") if getattr(args, f)]
        if alone:
            flags = ", ".join("--" + f.replace("_", "-") for f in alone)
            raise SwarmError(
                f"{flags}: only with --stage-servers; a scheduler's job keeps its own (`swarm "
                "export JOB --out FILE` for the model, `--routes FILE` for the route record, "
                "`swarm status JOB` for its steps)"
            )

        return asyncio.run(
            run_remote_trainer(
                args.scheduler,
                args.job,
                token=token(args),
                submitter_token=secret(args, "submitter-token"),
                threads=args.threads,
                metrics_port=args.metrics_port,
                metrics_token=metrics_token(args),
                broker=args.broker,
                retry_for_s=args.scheduler_retry_s,
            )
        )
    from client.standalone import parse_stage_servers, run_trainer
    from swarm.job.config import load_job
    from swarm.model.data import check_token_ids

    if not args.stage_servers:
        raise SwarmError("give --scheduler ADDR --job JOB_ID, or --job FILE --stage-servers ...")
    job = load_job(args.job)
    check_token_ids(job)  # before it trains, not at the step that draws one
    return asyncio.run(
        run_trainer(
            job,
            parse_stage_servers(args.stage_servers),
            out=args.out,
            log_path=args.log,
            threads=args.threads,
            metrics_port=args.metrics_port,
            metrics_token=metrics_token(args),
            token=token(args),
            checkpoint_dir=args.checkpoint_dir,
            broker=args.broker,
            routes=args.routes,
        )
    )
