"""What every stage script shares: the console, progress bars, the provenance written into outputs, and the
run log.

Outputs (and so DVC hashes) hold only what determines them: results, seeds, parameters and the versions of
the software (:func:`versions`). What changes from run to run without changing a result (the git commit,
wall-clock seconds, the machine's load) goes to the run log, ``logs/<stage>.json`` (git-ignored, not a DVC
output): :func:`run_log`.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

console = Console(stderr=True)


def progress() -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False)


def versions() -> dict[str, str]:
    """Versions of what produced an output, recorded beside the seeds (the same on every run of one set-up); read
    from the installed distributions' metadata, so that asking imports nothing."""
    from importlib import metadata

    from pipeline import __version__

    return {"pipeline": __version__, "python": platform.python_version(), "torch": metadata.version("torch"),
            "transformers": metadata.version("transformers")}


def git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = ""
    return commit or "unknown"


def run_log(stage: str, **info) -> None:
    """Record what varies between runs of the same inputs (seconds, commit, load) in ``logs/<stage>.json``."""
    from pipeline.files.atomic import write_json

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    write_json(f"logs/{stage}.json", {"stage": stage, "git_commit": git_commit(), "load_average": load,
                                      **versions(), **info})


def set_threads(threads: int | None) -> None:
    """Torch's intra-op threads (0 or None: its default)."""
    import torch

    if threads:
        torch.set_num_threads(threads)


@contextmanager
def stage_errors(name: str):
    """Turn expected errors (bad input, bad parameters) into a one-line message and exit code 1."""
    try:
        yield
    except (ValueError, FileNotFoundError, KeyError) as e:
        console.print(f"[bold red]{name}: error:[/] {e}")
        sys.exit(1)
