import pytest

from pipeline.eval.extract import ai2d_filter, choice_index, final_answer, final_answer_line, generation, short_answer
from pipeline.eval.tasks import EvalExample, score, score_cleaned

OPTIONS = ["circle", "square", "triangle", "star"]


@pytest.mark.parametrize(
    "response, answer",
    [
        ("The tallest bar is red.\nFINAL ANSWER: red", "red"),
        ("FINAL ANSWER: 5.", "5"),
        ("final answer: 12%", "12%"),
        ("FINAL ANSWER: 3.5", "3.5"),
        ("**FINAL ANSWER:** 7", "7"),
        ("FINAL ANSWER: a\nFINAL ANSWER: b\nmore", "b"),  # the last marker wins
        ('FINAL ANSWER: "blue"', "blue"),
        ("no marker here", "no marker here"),
        ("\n\nfirst line\nsecond", "first line"),
        ("", ""),
    ],
)
def test_final_answer(response, answer):
    assert final_answer(response) == answer


@pytest.mark.parametrize(
    "response, line",
    [
        ("The tallest bar is red.\nFINAL ANSWER: red", "red"),
        ("FINAL ANSWER: 5.", "5."),  # nothing cleaned
        ("FINAL ANSWER:  red \nmore", "red "),  # trailing whitespace kept (the harness strips it)
        ("final answer:\n\t45%\nmore", "45%"),
        ('FINAL ANSWER: "blue"', '"blue"'),
        ("**FINAL ANSWER:** 7", "** 7"),
        ("FINAL ANSWER: a\nFINAL ANSWER: b\nmore", "b"),
        (" no marker \nhere", " no marker \nhere"),  # the whole response
        ("", ""),
    ],
)
def test_final_answer_line(response, line):
    assert final_answer_line(response) == line


def test_generation_is_lmms_evals_harness_strip():
    assert generation(" \tred \n") == "red"
    assert generation("red\nbecause") == "red\nbecause"


def test_short_answer_is_the_stripped_generation():
    # lmms-eval scores VQAv2 / DocVQA generations whole (stripped); the metrics normalise the rest
    assert short_answer("  red \n") == "red"
    assert short_answer("red\nbecause it is") == "red\nbecause it is"
    assert short_answer('"lamp"') == '"lamp"'


@pytest.mark.parametrize(
    "response, index",
    [
        # lmms-eval's AI2D filter keeps the letter of a leading "X."; its exact match ignores case and ASCII
        # punctuation; anything else picks nothing
        ("B", 1),
        ("b", 1),
        ("(C)", 2),
        ("C)", 2),
        ("**A**", 0),
        ("B. square", 1),
        ("  B. square", 1),
        ("D.", 3),
        ("  D. \n", 3),
        ("  D \n", None),  # lmms-eval's exact match keeps whitespace (its harness strips before: see score)
        (" B", None),
        ("B\n", None),
        ("\tB", None),
        ("b.", 1),  # the filter wants a capital, but "b." without punctuation is "b"
        ("b. square", None),  # ... and "b square" is no letter
        ("B square", None),
        ("square", None),
        ("Square.", None),
        ("The answer is D.", None),
        ("FINAL ANSWER: A", None),
        ("3", None),  # an option number
        ("It is the triangle, I think", None),
        ("A or C", None),  # a hedge
        ("A diagram of text", None),
        ("E", None),  # no fifth option
        ("E.", None),
        ("", None),
    ],
)
def test_choice_index(response, index):
    assert choice_index(response, OPTIONS) == index


def test_choice_index_ignores_option_text_and_numbers():
    assert choice_index("2", ["4", "3", "2", "1"]) is None
    assert choice_index("B", ["4", "3", "2", "1"]) == 1


def test_ai2d_filter_is_lmms_evals():
    assert ai2d_filter("  B. circle") == "B"
    assert ai2d_filter("\nC.") == "C"
    assert ai2d_filter(" B \n") == " B \n"  # no leading "X.": the response as it is
    assert ai2d_filter("b. circle") == "b. circle"


def _ex(family, refs, options=None, answer=None):
    options = None if options is None else tuple(options)
    return EvalExample(f"t-{family}", "0", None, "q", "q", tuple(refs), options, answer)


def test_score_takes_lmms_evals_steps_in_its_order():
    # the filter sees the raw generation, the harness strips what it returns, the metric scores that
    assert score("ai2d", _ex("ai2d", ["B"], OPTIONS, 1), " B \n") == ("B", 1.0)
    assert score("ai2d", _ex("ai2d", ["B"], OPTIONS, 1), "\n B. square") == ("B", 1.0)
    assert score("ai2d", _ex("ai2d", ["B"], OPTIONS, 1), " square") == ("", 0.0)
    assert score("chartqa", _ex("chartqa", ["red"]), "The bar.\nFINAL ANSWER:  red \n") == ("red", 1.0)
    assert score("chartqa", _ex("chartqa", ["red"]), " red\n") == ("red", 1.0)  # no marker: the whole generation
    assert score("chartqa", _ex("chartqa", ["10"]), "FINAL ANSWER: 10.") == ("10.", 1.0)  # float("10.")
    assert score("chartqa", _ex("chartqa", ["red"]), "FINAL ANSWER: red.") == ("red.", 0.0)
    assert score("docvqa", _ex("docvqa", ["cat"]), "ca  \n") == ("ca", pytest.approx(1 - 1 / 3))
    assert score("vqa", _ex("vqa", ["red"] * 10), "\tRed.\n") == ("Red.", 1.0)


def test_score_cleaned_is_beside_and_cleans_only_chartqa():
    assert score_cleaned("chartqa", _ex("chartqa", ["red"]), "FINAL ANSWER: red.") == ("red", 1.0)
    assert score_cleaned("chartqa", _ex("chartqa", ["red"]), '**FINAL ANSWER:** "red"') == ("red", 1.0)
    assert score("chartqa", _ex("chartqa", ["red"]), '**FINAL ANSWER:** "red"')[1] == 0.0
    assert score_cleaned("chartqa", _ex("chartqa", ["10"]), "10\nbecause the bar") == ("10", 1.0)
    assert score("chartqa", _ex("chartqa", ["10"]), "10\nbecause the bar")[1] == 0.0
    for family, ex, response in [("vqa", _ex("vqa", ["red"] * 10), " red."),
                                 ("docvqa", _ex("docvqa", ["cat"]), "cats "),
                                 ("ai2d", _ex("ai2d", ["B"], OPTIONS, 1), " B")]:
        assert score_cleaned(family, ex, response) == score(family, ex, response)
