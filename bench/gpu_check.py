"""The device check's parts, each its own process (bench/gpu_check.sh installs the carried wheels
and runs this): one that fails or hangs is reported and the next still runs.

    python bench/gpu_check.py [--device cuda:0|cpu] [--quick] [--budget-s S] [--parts P,Q]
        [--ratio-shapes long,short] [--smoke-stall-s S] [--plan]

The device check (`DEVICE_PARTS`, one call of a lent machine: 8.5 minutes with the wheels, at most
8 files under $OUT), in this order:
1. environment: the versions this runs with, and nvidia-smi's line for the GPU;
2. smoke: 2 steps of swarm alone, 4 stage servers x 1 on the device, both shapes, the servers'
   INFO logs kept (bench/gpu_ratio.py --smoke): if it fails the check stops here, with the
   trainer's last errors, since every part after it would fail the same way, slower;
3. gpu ratio: swarm against single-process torch on the device (bench/gpu_ratio.py), the long
   shape first, as many runs as its budget holds;
4. CUDA tests: the tests that need CUDA (bench/gpu_cuda_tests.py picks them), on the device;
5. device faults: a real allocation failure mid-backward, replayed, and a float64 run, each on
   the device against the CPU reference (bench/gpu_fault_check.py; on a CPU the failure is
   injected, the dry run of its logic).
Where `--parts` names them (and in --quick, CI's run on a CPU, which runs every part):
doctor (`swarm doctor --device D --job examples/llama-1b.toml`), train fp32 / train bf16-mixed
(2 stages x 2 replicas against the CPU reference, bench/gpu_train_check.py: replicas bitwise
equal, audits agreeing, tokens/s and device memory per process), llama-1b (the 1B example,
bench/llama_1b.py, in bf16-mixed: tokens/s, MFU, device memory).

Each part has its seconds (`BUDGETS`) and runs in a session of its own, ended whole at its
timeout; the next starts once nothing of it is left and the device's memory is back where it
was (`bench.process_groups`), each part's figures say so. `--plan` prints the parts, their
seconds and commands and the files under $OUT, and runs nothing.

Every part prints PASS or FAIL with its figures; the summary goes to $OUT/gpu_check.txt when OUT
is set (rewritten after each part, so a run cut short still leaves what it found), with each
part's log beside it. Exit status 1 when a part failed. Only the standard library here: this
process touches no GPU and survives a broken torch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import process_groups  # noqa: E402

PY = sys.executable
LOG_BYTES = 200_000  # of each part's log kept under $OUT
PYTEST_ARGS = ("-q", "-p", "no:cacheprovider", "-p", "pytest_asyncio.plugin", "-p")
PYTEST_ARGS += ("pytest_timeout", "-p", "bench.gpu_cuda_tests", "-rs", "--timeout", "120")

# Dense bfloat16 tensor-core peaks (TFLOP/s, no sparsity), for the 1B example's MFU: the first
# name found in the GPU's name wins, so the specific ones come first.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("GH200", 989.4),
    ("H200", 989.4),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("RTX 5090", 209.5),
    ("RTX 4090", 165.2),
)

ENVIRONMENT = r"""
import json, platform, sys
out = {"python": platform.python_version()}
import torch
out["torch"] = torch.__version__
out["cuda"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    out["cudnn"] = torch.backends.cudnn.version()
    out["arch_list"] = torch.cuda.get_arch_list()
    i = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else 0
    if i < torch.cuda.device_count():
        out["gpu"] = torch.cuda.get_device_name(i)
        out["capability"] = "sm_%d%d" % torch.cuda.get_device_capability(i)
import numpy, grpc, google.protobuf
out["numpy"], out["grpcio"] = numpy.__version__, grpc.__version__
out["protobuf"] = google.protobuf.__version__
for name in ("aiomqtt", "amqtt", "grpc_health.v1.health", "cryptography", "pytest_asyncio"):
    __import__(name)
import swarm.proto.stage_pb2  # the generated code's protobuf check
print("RESULT " + json.dumps(out))
"""


# Each part's seconds (on a device; on a CPU), a timeout that ends its whole session
# (`bench.process_groups`). The device check (DEVICE_PARTS) fits one call of a lent machine,
# wheels included: `WHEELS_S` + theirs <= `TOTAL_S` (tests/system/test_gpu_check.py).
BUDGETS = {
    "environment": (20, 60),
    "smoke": (120, 200),
    "doctor": (90, 90),
    "CUDA tests": (90, 150),
    "train fp32": (240, 240),
    "train bf16-mixed": (240, 240),
    "llama-1b": (300, 300),
    "gpu ratio": (185, 300),
    "gpu idle": (215, 300),
    "device faults": (50, 180),
}
DEVICE_PARTS = ("environment", "smoke", "gpu ratio", "CUDA tests", "device faults")
ON_REQUEST = ("gpu idle",)  # only where --parts names them: --quick (CI) runs the others
GATE = "smoke"  # a failed smoke part stops the check: nothing after it could pass
TOTAL_S = 510.0  # the device check, from bench/gpu_check.sh's start (GPU_CHECK_STARTED)
WHEELS_S = 45  # bench/gpu_check.sh's install of the carried wheels, at most
QUICK_TOTAL_S = 420.0  # CI, on 2 shared cores: the smoke alone, then the rest side by side
MAX_OUT_FILES = 8  # what a lent machine's call brings back


@dataclass
class Part:
    name: str
    timeout_s: float
    command: Callable[[], list[str]]
    judge: Callable[[int, str], tuple[bool, str]]  # (exit status, output) -> (passed, figures)
    env: dict[str, str] = field(default_factory=dict)
    status: str = "not run"
    figures: str = ""
    seconds: float = 0.0


def slug(name: str) -> str:
    """A part's name as its log's: "CUDA tests" -> "CUDA-tests"."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name)


def result(output: str) -> dict[str, Any] | None:
    """The last `RESULT {json}` line of a part's output."""
    found = re.findall(r"(?m)^RESULT (\{.*\})$", output)
    return json.loads(found[-1]) if found else None


def tail(output: str, lines: int = 15) -> str:
    return "\n".join("    " + x for x in output.strip().splitlines()[-lines:])


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.device = args, args.device
        self.cuda = args.device.startswith("cuda")
        self.index = (args.device.partition(":")[2] or "0") if self.cuda else ""
        # TMPDIR read now, not when `tempfile` first looked: a test that sets it keeps the
        # check's folder under its own tmp_path, not one more in /tmp for every run
        self.work = Path(tempfile.mkdtemp(prefix="swarm-gpu-check-", dir=os.environ.get("TMPDIR")))
        self.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
        self.env: dict[str, Any] = {}
        self.header = ""
        everything = self._parts()
        chosen = args.parts or (set() if args.quick else set(DEVICE_PARTS))
        self.parts = [
            p for p in everything if p.name in chosen or (not chosen and p.name not in ON_REQUEST)
        ]

    # --- the parts ---------------------------------------------------------------------------

    def _parts(self) -> list[Part]:
        quick, dev = self.args.quick, self.device
        steps = ["--quick", "--steps", "3"] if quick else ["--steps", "20"]
        train = [PY, str(ROOT / "bench" / "gpu_train_check.py"), "--device", dev, *steps]
        tests_env = {
            "GPU_CHECK_TESTS_JSON": str(self.work / "tests.json"),
            # the suite's two plugins are named (`PYTEST_ARGS`): a GPU image's own, or this
            # venv's entry points loading pytest-asyncio a second time, are not (`_tests`)
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            **({"CUDA_VISIBLE_DEVICES": self.index} if self.cuda else {}),
        }
        parts = [
            Part("environment", 0, lambda: [PY, "-c", ENVIRONMENT, self.index], self._judge_env),
            Part("smoke", 0, self._smoke, self._judge_smoke),
            Part("doctor", 0, self._doctor, self._judge_doctor),
            Part("CUDA tests", 0, self._tests, self._judge_tests, env=tests_env),
            Part("train fp32", 0, lambda: [*train, "--precision", "fp32"], self._judge_train),
            Part(
                "train bf16-mixed",
                0,
                lambda: [*train, "--precision", "bf16-mixed"],
                self._judge_train,
            ),
            Part("llama-1b", 0, self._llama, self._judge_llama),
            Part("gpu ratio", 0, self._ratio, self._judge_ratio),
            Part("gpu idle", 0, self._idle, self._judge_idle),
            Part("device faults", 0, self._faults, self._judge_faults),
        ]
        for part in parts:
            part.timeout_s = self._timeout(part.name)
        if quick:  # CI: every part, the smoke first
            return parts
        by_name = {p.name: p for p in parts}
        return [by_name[name] for name in DEVICE_PARTS] + [
            p
            for p in parts
            if p.name not in DEVICE_PARTS  # only where --parts names them
        ]

    def _judge_env(self, code: int, output: str) -> tuple[bool, str]:
        self.env = result(output) or {}
        if code or not self.env:
            return False, f"the imports failed:\n{tail(output)}"
        e = self.env
        text = (
            f"python {e['python']}, torch {e['torch']} (CUDA {e['cuda']}, cuDNN "
            f"{e.get('cudnn')}), numpy {e['numpy']}, grpcio {e['grpcio']}, protobuf "
            f"{e['protobuf']}; GPU {e.get('gpu', '-')} {e.get('capability', '')}"
        )
        smi = shutil.which("nvidia-smi")
        if smi:
            query = "name,driver_version,memory.total,memory.used,power.limit"
            line = subprocess.run(
                [smi, f"--query-gpu={query}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
            text += "\n    nvidia-smi: " + "\n    nvidia-smi: ".join(line.strip().splitlines())
        elif self.cuda:
            text += "\n    nvidia-smi: not found"
        ok = not self.cuda or bool(e.get("gpu"))
        return ok, text if ok else f"{text}; torch sees no {self.device}"

    def _doctor(self) -> list[str]:
        job = ROOT / "examples" / "llama-1b.toml"
        return [PY, "-m", "swarm.cli", "doctor", "--device", self.device, "--job", str(job)]

    def _judge_doctor(self, code: int, output: str) -> tuple[bool, str]:
        return code == 0, "\n".join("    " + x for x in output.strip().splitlines())

    def _tests(self) -> list[str]:
        # The whole suite is collected: bench/gpu_cuda_tests.py keeps the tests that say they
        # need CUDA, wherever they are. A module that does not import here (a package the host
        # lacks) is named, not fatal (--continue-on-collection-errors).
        # A GPU image's own pytest plugins (benchmark, xdist, cov, ...) may not agree with the
        # carried pytest: autoloading is off (the part's environment, whether or not
        # gpu_check.sh started this) and the suite's two are named here.
        return [PY, "-m", "pytest", *PYTEST_ARGS, "--continue-on-collection-errors", "tests"]

    def _judge_tests(self, code: int, output: str) -> tuple[bool, str]:
        path = self.work / "tests.json"
        outcomes: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
        counts = {k: sum(1 for v in outcomes.values() if v == k) for k in set(outcomes.values())}
        text = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no tests ran"
        failed = [n for n, v in outcomes.items() if v == "failed"]
        skipped = [n for n, v in outcomes.items() if v == "skipped"]
        unimported = [n for n, v in outcomes.items() if v == "uncollected"]
        if unimported:
            text += f" ({len(unimported)} modules did not import here: {unimported})"
        ran = len(outcomes) - len(unimported)
        if failed or not ran or code not in (0, 1, 5) or (code == 1 and not unimported):
            return False, f"{text}; failed: {failed}\n{tail(output, 40)}"
        if self.cuda and skipped:
            return False, f"{text}: skipped on a GPU host: {skipped}\n{tail(output)}"
        return True, text + ("" if self.cuda else " (no GPU asked: --device cpu)")

    def _judge_train(self, code: int, output: str) -> tuple[bool, str]:
        r = result(output)
        if r is None:
            return False, f"no result (exit {code}):\n{tail(output, 30)}"
        mib = 1 << 20
        peaks = r["device_peak_bytes"]
        memory = (
            "device memory per server (max_memory_allocated) "
            + ", ".join(f"{p / mib:.0f}" for p in peaks)
            + " MiB"
            if all(p is not None for p in peaks)
            else "peak RSS per server "
            + ", ".join(f"{p / mib:.0f}" for p in r["peak_rss_bytes"])
            + " MiB"
        )
        text = (
            f"{r['steps']} steps, loss {r['loss_first']:.4f} -> {r['loss_last']:.4f}; against the "
            f"CPU reference: loss {r['loss_rel_err']:.2e}, parameters {r['param_rel_err']:.2e} "
            f"({r['param_worst']}); replicas of each stage bitwise equal: "
            f"{'yes' if r['replicas_bitwise_equal'] else 'NO'}; "
            f"audits {r['audits'].get('agreed', 0)} agreed (largest difference "
            f"{r['audit_max_difference']:.1e}); {r['tokens_per_s']:.0f} tokens/s; {memory}"
        )
        if self.cuda and not all(p is not None for p in peaks):
            r["failures"].append("a server logged no device memory: did it run on the GPU?")
        if code or r["failures"]:
            return False, text + "\n    " + "\n    ".join(r["failures"] or [f"exit {code}"])
        return True, text

    def _peak_tflops(self) -> float:
        gpu = str(self.env.get("gpu", ""))
        return next((peak for name, peak in BF16_PEAK_TFLOPS if name in gpu), 0.0)

    def _llama(self) -> list[str]:
        cmd = [
            PY,
            str(ROOT / "bench" / "llama_1b.py"),
            "--device",
            self.device,
            "--json",
            "--precision",
            "bf16-mixed",
            "--checkpoint-every",
            "0",
        ]
        if self.args.quick:
            return [*cmd, "--tiny", "--steps", "2", "--microbatch-size", "2", "--batch", "4"]
        peak = self._peak_tflops()
        cmd += ["--steps", "6", "--microbatch-size", "4", "--batch", "16"]
        return cmd + (["--peak-tflops", str(peak)] if peak else [])

    def _judge_llama(self, code: int, output: str) -> tuple[bool, str]:
        # --json's object, indented: the last line "{" to the last line "}"
        start = 0 if output.startswith("{\n") else output.rfind("\n{\n") + 1
        end = output.rfind("\n}") + 2
        try:
            r = json.loads(output[start:end])
        except ValueError:
            return False, f"no result (exit {code}):\n{tail(output, 30)}"
        gib = 1 << 30
        peaks = r.get("device_peak") or []
        memory = (
            "device memory per server (max_memory_allocated) "
            + ", ".join(f"{p / gib:.2f}" for p in peaks)
            + " GiB"
            if peaks and all(p is not None for p in peaks)
            else "peak RSS per server "
            + ", ".join(f"{p / gib:.2f}" for p in r["peak_rss"])
            + " GiB"
        )
        mfu = r.get("mfu")
        peak = self._peak_tflops()
        mfu_text = (
            f"MFU {100 * mfu:.2f}% of {peak:.0f} TFLOP/s (dense bf16, {self.env.get('gpu')})"
            if mfu
            else "MFU: no peak known for this device"
        )
        text = (
            f"{sum(r['params']) / 1e9:.3f}B parameters, bf16-mixed, microbatch x batch "
            f"{r['batch']}, {len(r['losses'])} steps (servers ready in {r['start_seconds']:.0f} s):"
            f" losses {[round(x, 3) for x in r['losses']]}; {r['tokens_per_s']:.0f} tokens/s, "
            f"{r['model_tflops']:.2f} model TFLOP/s, {mfu_text}; {memory}"
        )
        losses = r["losses"]
        if code or not losses or any(x != x for x in losses):  # NaN != NaN
            return False, f"{text}\n{tail(output)}"
        return True, text

    def _smoke(self) -> list[str]:
        """2 steps of swarm alone, 4 stage servers x 1 on the device, both shapes, the servers'
        INFO logs kept: whatever stops the runs after it shows here first, in seconds."""
        cmd = [PY, str(ROOT / "bench" / "gpu_ratio.py"), "--device", self.device, "--smoke"]
        cmd += ["--shapes", "short,long"] + ([] if self.cuda else ["--cpu-tiny"])
        # --smoke-stall-s: a test's smoke that stalls on purpose stops sooner than at the bench's
        # own bound (bench/gpu_ratio.py's STALL_S)
        cmd += ["--stall-s", str(self.args.smoke_stall_s)] if self.args.smoke_stall_s else []
        return [*cmd, "--budget-s", str(self._timeout("smoke") - 10)]

    def _judge_smoke(self, code: int, output: str) -> tuple[bool, str]:
        r = result(output)
        if r is None:
            return False, f"no result (exit {code}):\n{tail(output, 30)}"
        shapes = []
        for shape, found in r["shapes"].items():
            row = found["rows"].get("swarm", {})
            losses = [round(x, 4) for x in row.get("losses", [])]
            shapes.append(f"{shape}: losses {losses}, {row.get('handed', 0)} tensors handed over")
        text = f"swarm alone, 4 stage servers on {r['device']}, {r['precision']}: " + "; ".join(
            shapes
        )
        if code or r["failures"]:
            return False, text + "\n    " + "\n    ".join(r["failures"] or [f"exit {code}"])
        return True, text

    def _timeout(self, name: str) -> float:
        """A part's seconds: a device's, or CI's on a CPU (tiny sizes, 2 shared cores)."""
        return BUDGETS[name][1 if self.args.quick or not self.cuda else 0]

    def _ratio(self) -> list[str]:
        cmd = [PY, str(ROOT / "bench" / "gpu_ratio.py"), "--device", self.device]
        if self.args.quick:  # fp32 on a CPU: swarm's losses equal torch's within 1e-4
            tiny = ["--cpu-tiny", "--shapes", "short", "--warmup", "1", "--steps", "2"]
            return [*cmd, *tiny, "--precision", "fp32", "--mps"]  # says MPS is not available
        peak = self._peak_tflops()
        cmd += ["--shapes", self.args.ratio_shapes, "--warmup", "2", "--steps", "4"]
        cmd += ["--budget-s", str(self._timeout("gpu ratio") - 15)]  # it ends its own runs
        return cmd + (["--peak-tflops", str(peak)] if peak else [])

    def _judge_ratio(self, code: int, output: str) -> tuple[bool, str]:
        r = result(output)
        tables = [x for x in output.splitlines() if x.startswith(("|", "###", "MPS A/B"))]
        text = "\n".join("    " + x for x in tables)
        if r is None:
            return False, f"no result (exit {code}):\n{tail(output, 30)}"
        if code or r["failures"]:
            return False, text + "\n    " + "\n    ".join(r["failures"] or [f"exit {code}"])
        return True, "swarm against torch on the same device\n" + text

    def _idle(self) -> list[str]:
        """Where a swarm step's time goes (bench/timeline_report.py), the long shape eager
        beside torch's two runs: more timed steps than the ratio's, the servers sampled by
        py-spy, the run's trace (Perfetto) and py-spy's stacks under $OUT."""
        cmd = [PY, str(ROOT / "bench" / "gpu_ratio.py"), "--device", self.device]
        cmd += ["--cpu-tiny"] if not self.cuda else []
        cmd += ["--shapes", "long", "--compile", "off", "--warmup", "2", "--steps", "6"]
        cmd += ["--budget-s", str(self._timeout("gpu idle") - 15), "--py-spy"]
        cmd += ["--out", str(self.out / "gpu_idle")] if self.out else []
        peak = self._peak_tflops()
        return cmd + (["--peak-tflops", str(peak)] if peak else [])

    def _judge_idle(self, code: int, output: str) -> tuple[bool, str]:
        passed, text = self._judge_ratio(code, output)
        lines = output.splitlines()
        if not passed or not any("Where a swarm step's time" in x for x in lines):
            return False, text if not passed else f"{text}\n    no timeline was reported"
        # the table, the breakdown, the evictions, py-spy's summaries: up to the run's result
        start = next(i for i, x in enumerate(lines) if x.startswith("### "))
        told = [x for x in lines[start:] if not x.startswith("RESULT ")]
        return True, "where a swarm step's time goes\n" + "\n".join("    " + x for x in told)

    def _faults(self) -> list[str]:
        cmd = [PY, str(ROOT / "bench" / "gpu_fault_check.py"), "--device", self.device]
        return [*cmd, "--steps", "1" if self.args.quick else "2"]

    def _judge_faults(self, code: int, output: str) -> tuple[bool, str]:
        r = result(output)
        if r is None:
            return False, f"no result (exit {code}):\n{tail(output, 30)}"
        text = (
            f"float64 on {r['device']} against the CPU reference {r['float64_rel_err']:.2e}; out "
            f"of memory mid-backward ({r['failure']}), replayed: {r['after_failure_rel_err']:.2e}"
            f", bitwise the run without it: {'yes' if r['bitwise_as_without'] else 'NO'}"
        )
        if code or r["failures"]:
            return False, text + "\n    " + "\n    ".join(r["failures"] or [f"exit {code}"])
        return True, text

    # --- running -----------------------------------------------------------------------------

    def run_part(self, part: Part, deadline: float) -> None:
        """`part` in a session of its own, ended whole at its timeout; then, before the next
        part may start, checked to have left no process and the device's memory where it was
        (`bench.process_groups`), said in its figures."""
        left = deadline - time.monotonic()
        if left < 5:
            part.status, part.figures = "FAIL", "not run: the check's time budget is spent"
            return
        log = self.work / f"{slug(part.name)}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **part.env}
        if self.args.quick and not self.cuda:  # CI: stage servers forked (bench/forked_servers.py)
            env["GPU_CHECK_FORKED"] = "1"
        before = process_groups.device_memory_mib(self.device)
        timeout = min(part.timeout_s, left)
        with open(log, "w", encoding="utf-8", errors="replace") as f:
            ended = process_groups.run(
                part.command(),
                out=f,
                timeout=timeout,
                kind=process_groups.Kind.SESSION,  # the part, its phases and their servers
                env=env,
                cwd=ROOT,
            )
        settled, line = process_groups.settle(
            ended, before, lambda: process_groups.device_memory_mib(self.device)
        )
        output = log.read_text(encoding="utf-8", errors="replace")
        try:
            passed, part.figures = part.judge(ended.code, output)
        except Exception as e:  # a judge that cannot read the output fails its part only
            passed, part.figures = False, f"{type(e).__name__}: {e}"
        if ended.stopped:  # what it found before, where its judge can read it
            passed, part.figures = False, f"{ended.why}; {part.figures}\n{tail(output)}"
        part.figures += f"\n    {line}"
        part.seconds = ended.seconds
        part.status = "PASS" if passed and settled else "FAIL"
        print(f"  {part.name}: {line}", flush=True)
        if self.out:
            logs = self.out / "gpu_check_logs"
            logs.mkdir(parents=True, exist_ok=True)
            data = log.read_bytes()
            (logs / log.name).write_bytes(data[-LOG_BYTES:])

    def out_files(self) -> list[str]:
        """The files a run leaves under $OUT: the summary and each part's log (gpu idle's
        trace and stacks beside them)."""
        idle = ["gpu_idle/trace-long-swarm.json", "gpu_idle/py-spy-long-swarm.txt"]
        return (
            ["gpu_check.txt"]
            + [f"gpu_check_logs/{slug(p.name)}.log" for p in self.parts]
            + (idle if "gpu idle" in {p.name for p in self.parts} else [])
        )

    def report(self) -> str:
        lines = [self.header]
        for p in self.parts:
            lines.append(f"{p.status:<7} {p.name} ({p.seconds:.0f} s): {p.figures}")
        failed = [p.name for p in self.parts if p.status != "PASS"]
        lines.append(
            f"{len(self.parts) - len(failed)} of {len(self.parts)} parts passed"
            + (f"; not passed: {', '.join(failed)}" if failed else "")
        )
        return "\n".join(lines) + "\n"

    def save(self) -> None:
        if self.out:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "gpu_check.txt").write_text(self.report())

    def run(self) -> int:
        process_groups.become_subreaper()  # a part's orphans come here, to be reaped
        started = time.monotonic()
        deadline = started + self.args.budget_s
        self.header = (
            f"swarm device check: --device {self.device}{' --quick' if self.args.quick else ''}, "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, budget "
            f"{self.args.budget_s:.0f} s"
        )
        print(self.header, flush=True)
        self.save()
        # The parts up to the smoke run one at a time (the first's GPU name picks the MFU peak
        # of the parts after it); a failed smoke stops the check with its first error.
        names = [p.name for p in self.parts]
        first = self.parts[: names.index(GATE) + 1] if GATE in names else self.parts[:1]
        for part in first:
            self.run_part(part, deadline)
            self._show(part)
            if part.name == GATE and part.status != "PASS":
                for skipped in self.parts[len(first) :]:
                    skipped.figures = f"not run: the {GATE} part failed"
                return self._finish(started)
        rest = self.parts[len(first) :]
        # On a CPU (CI) the parts share the machine and run side by side; on a GPU one at a time,
        # so that each one's tokens/s and memory are its own.
        with ThreadPoolExecutor(max_workers=max(len(rest), 1) if self.args.quick else 1) as pool:
            for part, _ in [(p, pool.submit(self.run_part, p, deadline)) for p in rest]:
                _.result()
                self._show(part)
        return self._finish(started)

    def _finish(self, started: float) -> int:
        self.save()
        print(self.report().splitlines()[-1])
        print(f"total {time.monotonic() - started:.0f} s; logs in {self.work}", flush=True)
        return 0 if all(p.status == "PASS" for p in self.parts) else 1

    def plan(self) -> dict[str, Any]:
        """What a run would do, without running it (--plan): the parts in order with their
        seconds and commands, the check's budget, the files under $OUT."""
        return {
            "parts": [
                {"name": p.name, "timeout_s": p.timeout_s, "command": p.command()}
                for p in self.parts
            ],
            "budget_s": self.args.budget_s,
            "out_files": self.out_files(),
        }

    def _show(self, part: Part) -> None:
        print(f"{part.status:<7} {part.name} ({part.seconds:.0f} s): {part.figures}", flush=True)
        self.save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0", help="cuda:N or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, parts side by side (CI)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds for all parts ({TOTAL_S:.0f} from gpu_check.sh's start; quick: "
        f"{QUICK_TOTAL_S:.0f})",
    )
    parser.add_argument(
        "--parts", default="", help="comma-separated part names to run (default: DEVICE_PARTS)"
    )
    parser.add_argument(
        "--ratio-shapes", default="long,short", help="bench/gpu_ratio.py's shapes, in order"
    )
    parser.add_argument(
        "--smoke-stall-s",
        type=float,
        default=0.0,
        help="the smoke part's stall bound (0: bench/gpu_ratio.py's own)",
    )
    parser.add_argument("--plan", action="store_true", help="print what would run, run nothing")
    args = parser.parse_args()
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if args.budget_s is None:
        # The device check's minutes count from the script's start: the wheels' install too.
        began = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
        args.budget_s = QUICK_TOTAL_S if args.quick else TOTAL_S - (time.time() - began)
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device {args.device!r}: cpu or cuda:N")
    check = Check(args)
    if args.plan:
        print("PLAN " + json.dumps(check.plan()))
        return 0
    return check.run()


if __name__ == "__main__":
    sys.exit(main())
