"""examples/llama-1b.toml, the job of the 1B example and of the device check's runs, with keys of
its own set (`set_keys`), and the tiny sizes a CPU trains it at (`TINY`). No torch here: the
device check's processes that only write a job (bench/gpu_ratio.py's, which starts the runs)
need not import it."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["JOB", "TINY", "set_keys"]

JOB = Path(__file__).resolve().parent.parent / "examples" / "llama-1b.toml"
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "mlp_hidden": 128, "seq_len": 32}


def set_keys(text: str, keys: dict[str, object]) -> str:
    """The example's job text with `keys` (each one line `key = value` in it) set."""
    for key, value in keys.items():
        text, n = re.subn(rf"(?m)^{key} = [^#\n]*", f"{key} = {value} ", text)
        if n != 1:
            raise SystemExit(f"examples/llama-1b.toml has no single {key} to override")
    return text
