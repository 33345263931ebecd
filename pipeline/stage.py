"""What every stage script shares: the console, progress bars, and the provenance written into outputs."""

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
    """Versions of what produced an output, recorded beside the seeds."""
    import torch
    import transformers

    from pipeline import __version__

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = ""
    return {"pipeline": __version__, "git_commit": commit or "unknown", "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}


def set_threads(threads: int | None) -> None:
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
