"""Evaluation tasks: the four real benchmarks (through ``datasets``) and their toy counterparts.

Every task yields the same ``EvalExample`` records: a seeded shuffle of the source, then its first ``n``
examples (SPEC section 6: 1,024 by default), each with the benchmark's prompt and its references. Scoring an
example's response is the task family's job (``score``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from pipeline.eval import extract, metrics
from pipeline.eval.task_prompts import option_letter, prompt_for

DEFAULT_N = 1024


@dataclass(frozen=True)
class EvalExample:
    task: str
    id: str
    image: Image.Image
    question: str
    prompt: str  # the user text given to the model (next to the image)
    references: tuple[str, ...]
    options: tuple[str, ...] | None = None  # multiple choice only
    answer_index: int | None = None  # multiple choice only


# --- scoring --------------------------------------------------------------------------------------------


def score(family: str, example: EvalExample, response: str) -> tuple[str, float]:
    """(extracted answer, score in [0, 1]) of one response exactly as lmms-eval scores it: ``response`` is the
    decoded generation as is (lmms-eval's Llama 3.2 Vision wrapper strips nothing); the family's filter sees it
    unstripped (AI2D's letter filter; ChartQA's "FINAL ANSWER:" line, SPEC section 6), lmms-eval's harness
    strips what the filter returns (``extract.generation``), then the family's metric scores it."""
    if family == "vqa":
        answer = extract.short_answer(response)
        return answer, metrics.vqa_accuracy(answer, example.references)
    if family == "chartqa":
        answer = extract.generation(extract.final_answer_line(response))
        return answer, metrics.relaxed_accuracy(answer, example.references)
    if family == "docvqa":
        answer = extract.short_answer(response)
        return answer, metrics.anls(answer, example.references)
    if family == "ai2d":
        if example.options is None or example.answer_index is None:
            raise ValueError(f"{example.id}: multiple-choice example without options or answer")
        choice = extract.choice_index(extract.generation(extract.ai2d_filter(response)), example.options)
        return ("" if choice is None else option_letter(choice)), metrics.multiple_choice_accuracy(choice, example.answer_index)
    raise ValueError(f"unknown task family {family!r}")


def score_cleaned(family: str, example: EvalExample, response: str) -> tuple[str, float]:
    """(answer, score) of the cleaned-up variant, reported beside ``score`` (never instead): ChartQA's answer
    is ``extract.final_answer`` (the first non-empty line without the marker; quotes, asterisks and a trailing
    period removed); the other families have nothing to clean and score as ``score``."""
    if family == "chartqa":
        answer = extract.final_answer(response)
        return answer, metrics.relaxed_accuracy(answer, example.references)
    return score(family, example, response)


# --- real benchmarks ------------------------------------------------------------------------------------


class DatasetUnavailable(RuntimeError):
    """A benchmark's data set could not be loaded; the message says how to provide it."""


@dataclass(frozen=True)
class Benchmark:
    name: str
    family: str
    hub_id: str
    config: str | None
    split: str
    to_example: Callable[[str, int, dict], EvalExample]  # (task, source row, row)


def _rgb(image) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise TypeError(f"expected a decoded image, got {type(image).__name__}")
    return image.convert("RGB")


def _vqav2(task: str, i: int, row: dict) -> EvalExample:
    refs = tuple(a["answer"] for a in row["answers"])
    q = row["question"]
    return EvalExample(task, str(row["question_id"]), _rgb(row["image"]), q, prompt_for("vqa", q), refs)


def _chartqa(task: str, i: int, row: dict) -> EvalExample:
    labels = row["label"]
    refs = tuple(labels) if isinstance(labels, (list, tuple)) else (str(labels),)
    q = row["query"]
    return EvalExample(task, str(i), _rgb(row["image"]), q, prompt_for("chartqa", q), refs)


def _docvqa(task: str, i: int, row: dict) -> EvalExample:
    q = row["question"]
    return EvalExample(task, str(row["questionId"]), _rgb(row["image"]), q, prompt_for("docvqa", q), tuple(row["answers"]))


def _ai2d(task: str, i: int, row: dict) -> EvalExample:
    options = tuple(row["options"])
    index = int(row["answer"])
    q = row["question"]
    return EvalExample(task, str(i), _rgb(row["image"]), q, prompt_for("ai2d", q, options),
                       (option_letter(index),), options, index)


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in [
        Benchmark("vqav2", "vqa", "lmms-lab/VQAv2", None, "validation", _vqav2),
        Benchmark("chartqa", "chartqa", "HuggingFaceM4/ChartQA", None, "test", _chartqa),
        Benchmark("docvqa", "docvqa", "lmms-lab/DocVQA", "DocVQA", "validation", _docvqa),
        Benchmark("ai2d", "ai2d", "lmms-lab/ai2d", None, "test", _ai2d),
    ]
}


def _load_dataset(bench: Benchmark, source: str):
    import datasets

    path = Path(source)
    how = (
        f"Provide it as the hub id {bench.hub_id!r} (config {bench.config!r}, split {bench.split!r}) on a machine "
        f"that can reach the Hugging Face hub or has it in its datasets cache, or as a local path: a Parquet "
        f"file, a folder of Parquet files in that data set's schema, or a folder written by Dataset.save_to_disk."
    )
    try:
        if path.exists():
            if path.is_dir() and (path / "state.json").exists():
                return datasets.load_from_disk(str(path))
            files = [path] if path.is_file() else sorted(path.rglob("*.parquet"))
            if not files:
                raise FileNotFoundError(f"no .parquet files under {path}")
            of_split = [f for f in files if bench.split in f.name]
            data_files = [str(f) for f in (of_split or files)]
            return datasets.load_dataset("parquet", data_files={bench.split: data_files}, split=bench.split)
        if source.startswith((".", "/")) or source.count("/") != 1:
            raise FileNotFoundError(f"no such file or folder: {source}")
        return datasets.load_dataset(source, bench.config, split=bench.split)
    except Exception as e:  # datasets raises many kinds (offline, not found, connection, schema)
        raise DatasetUnavailable(f"{bench.name}: cannot load {source!r}: {type(e).__name__}: {e}. {how}") from e


def load_benchmark(name: str, n: int = DEFAULT_N, seed: int = 0, source: str | None = None) -> list[EvalExample]:
    """The first ``n`` examples of benchmark ``name`` after a shuffle with ``seed``. ``source`` is a hub id
    (default: the benchmark's) or a local path."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {sorted(BENCHMARKS)}")
    bench = BENCHMARKS[name]
    ds = _load_dataset(bench, source or bench.hub_id)
    # the permutation datasets' shuffle(seed) uses, kept so that each example knows its source row
    rows = np.random.default_rng(seed).permutation(len(ds))[:n].tolist()
    return [bench.to_example(name, r, row) for r, row in zip(rows, ds.select(rows))]


# --- the task registry ------------------------------------------------------------------------------------

TaskLoader = Callable[[int, int, "str | None"], list[EvalExample]]   # (n, seed, source) -> examples


@dataclass(frozen=True)
class Task:
    name: str
    family: str          # which metric scores it: vqa, chartqa, docvqa or ai2d
    load: TaskLoader


_TASKS: dict[str, Task] = {}


def register(name: str, family: str, load: TaskLoader) -> None:
    """Make task ``name`` known to :func:`load_task` (the toy world registers its tasks this way)."""
    if family not in FAMILIES:
        raise ValueError(f"task {name!r}: unknown family {family!r}; known: {', '.join(FAMILIES)}")
    _TASKS[name] = Task(name, family, load)


FAMILIES = ("vqa", "chartqa", "docvqa", "ai2d")
for _bench in BENCHMARKS.values():
    register(_bench.name, _bench.family,
             lambda n, seed, source, _name=_bench.name: load_benchmark(_name, n, seed, source))


def known() -> list[str]:
    return sorted(_TASKS)


def family_of(name: str) -> str:
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; known: {known()} (toy tasks are known once pipeline.toy is imported)")
    return _TASKS[name].family


def load_task(name: str, n: int = DEFAULT_N, seed: int = 0, source: str | None = None) -> list[EvalExample]:
    """Examples of any registered task: a real benchmark ("vqav2", ...) or a toy task ("toy-vqa", ...)."""
    family_of(name)
    return _TASKS[name].load(n, seed, source)
