"""Benchmark loaders on local Parquet fixtures in each hub data set's schema (tests/fixtures/make_fixtures.py),
the seeded slice, the missing-data error, and scoring by task family."""

from pathlib import Path

import pytest

from pipeline.eval.tasks import (
    BENCHMARKS,
    DatasetUnavailable,
    EvalExample,
    family_of,
    load_benchmark,
    load_task,
    score,
)
from pipeline.toy.tasks import load_toy

FIXTURES = Path(__file__).parent / "fixtures"
SOURCES = {
    "vqav2": FIXTURES / "vqav2",
    "chartqa": FIXTURES / "chartqa",
    "docvqa": FIXTURES / "docvqa",
    "ai2d": FIXTURES / "ai2d" / "data" / "test-00000-of-00001.parquet",  # a single file works too
}
SIZES = {"vqav2": 6, "chartqa": 5, "docvqa": 5, "ai2d": 5}


def test_benchmarks_are_the_paper_suite():
    assert {(b.hub_id, b.config, b.split) for b in BENCHMARKS.values()} == {
        ("lmms-lab/VQAv2", None, "validation"),
        ("HuggingFaceM4/ChartQA", None, "test"),
        ("lmms-lab/DocVQA", "DocVQA", "validation"),
        ("lmms-lab/ai2d", None, "test"),
    }


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_fixture_loads_with_seeded_slice(name):
    everything = load_benchmark(name, n=100, seed=0, source=str(SOURCES[name]))
    assert len(everything) == SIZES[name]
    again = load_benchmark(name, n=100, seed=0, source=str(SOURCES[name]))
    assert [e.id for e in everything] == [e.id for e in again]
    head = load_benchmark(name, n=3, seed=0, source=str(SOURCES[name]))
    assert [e.id for e in head] == [e.id for e in everything[:3]]
    orders = {tuple(e.id for e in load_benchmark(name, n=100, seed=s, source=str(SOURCES[name]))) for s in range(4)}
    assert len(orders) > 1  # the seed shuffles
    for e in everything:
        assert e.task == name and e.image.mode == "RGB" and e.references and e.question in e.prompt


def test_vqav2_rows():
    examples = {e.id: e for e in load_benchmark("vqav2", n=10, source=str(SOURCES["vqav2"]))}
    e = examples["1000"]
    assert e.question == "What color is the box?" and len(e.references) == 10 and e.references[8] == "dark blue"
    assert e.prompt == "What color is the box?\nAnswer the question using a single word or phrase."
    assert score("vqa", e, "Blue.")[1] == 1.0
    assert score("vqa", examples["1005"], "badminton")[1] == pytest.approx(0.3)


def test_chartqa_rows():
    examples = {e.question: e for e in load_benchmark("chartqa", n=10, source=str(SOURCES["chartqa"]))}
    e = examples["What is the sum of A and B?"]
    assert e.references == ("17.5",) and "FINAL ANSWER" in e.prompt
    assert score("chartqa", e, "A is 10 and B is 7.5.\nFINAL ANSWER: 17.6") == ("17.6", 1.0)
    assert score("chartqa", e, "FINAL ANSWER: 19")[1] == 0.0
    assert score("chartqa", examples["What percentage is shown for C?"], "FINAL ANSWER: 35%")[1] == 1.0


def test_docvqa_rows():
    examples = {e.id: e for e in load_benchmark("docvqa", n=10, source=str(SOURCES["docvqa"]))}
    e = examples["5000"]
    assert e.references == ("March 3, 1998", "3 March 1998")
    assert score("docvqa", e, "3 March 1998")[1] == 1.0
    assert score("docvqa", e, "March 3 1998")[1] == pytest.approx(1 - 1 / 13)


def test_ai2d_rows():
    examples = {e.question: e for e in load_benchmark("ai2d", n=10, source=str(SOURCES["ai2d"]))}
    e = examples["How many legs does it have?"]
    assert e.options == ("2", "4", "6", "8") and e.answer_index == 2 and e.references == ("C",)
    assert e.prompt == (
        "How many legs does it have?\nA. 2\nB. 4\nC. 6\nD. 8\n"
        "Answer with the option's letter from the given choices directly."
    )
    assert score("ai2d", e, "C") == ("C", 1.0)
    assert score("ai2d", e, "6") == ("", 0.0)  # option text picks nothing (lmms-eval)
    assert score("ai2d", e, "B") == ("B", 0.0)
    three = examples["What eats the grass?"]
    assert three.options == ("rabbit", "hawk", "snake") and "D." not in three.prompt


def test_missing_dataset_says_how_to_provide_it(tmp_path):
    with pytest.raises(DatasetUnavailable) as e:
        load_benchmark("docvqa", source=str(tmp_path / "nowhere"))
    message = str(e.value)
    assert "lmms-lab/DocVQA" in message and "'DocVQA'" in message and "local path" in message
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DatasetUnavailable, match="no .parquet files"):
        load_benchmark("ai2d", source=str(empty))


def test_unknown_tasks_are_errors():
    with pytest.raises(ValueError, match="unknown benchmark"):
        load_benchmark("mmmu")
    with pytest.raises(ValueError, match="unknown task"):
        load_task("toy-mmmu")
    with pytest.raises(ValueError, match="take no source"):
        load_task("toy-vqa", 2, source="somewhere")


def test_toy_tasks_load_held_out_items():
    examples = load_task("toy-ai2d", 5, seed=1)
    assert len(examples) == 5 and all(isinstance(e, EvalExample) for e in examples)
    assert all(e.options and e.answer_index is not None for e in examples)
    assert [e.id for e in examples] == [e.id for e in load_toy("toy-ai2d", 5, seed=1)]
    assert {family_of(t) for t in ("toy-vqa", "toy-chartqa", "toy-docvqa", "toy-ai2d")} == {"vqa", "chartqa", "docvqa", "ai2d"}


def test_score_needs_options_for_multiple_choice():
    e = load_toy("toy-vqa", 1)[0]
    with pytest.raises(ValueError, match="without options"):
        score("ai2d", e, "A")
