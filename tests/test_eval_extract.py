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


def test_short_answer_is_first_line():
    assert short_answer("red\nbecause it is") == "red"


@pytest.mark.parametrize(
    "response, index",
    [
        ("B", 1),
        ("(C)", 2),
        ("B. square", 1),
        ("D.", 3),
        ("square", 1),
        ("Square.", 1),
        ("The answer is D.", 3),
        ("FINAL ANSWER: A", 0),
        ("3", 2),  # an option number
        ("It is the triangle, I think", 2),
        ("E", None),  # no fifth option
        ("circle or square", None),  # ambiguous
        ("", None),
    ],
)
def test_choice_index(response, index):
    assert choice_index(response, OPTIONS) == index


def test_choice_index_prefers_option_text_to_option_number():
    assert choice_index("2", ["4", "3", "2", "1"]) == 2
