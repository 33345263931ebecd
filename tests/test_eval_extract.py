import pytest

from pipeline.eval.extract import choice_index, final_answer, short_answer

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
        ("  D \n", 3),
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
