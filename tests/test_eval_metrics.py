"""Worked examples, with scores computed by hand, for each benchmark metric (lmms-eval's behaviour; the parity
with lmms-eval's own code is tests/test_lmms_eval_parity.py)."""

import pytest

from pipeline.eval.metrics import (
    anls,
    levenshtein,
    multiple_choice_accuracy,
    normalize_vqa_answer,
    relaxed_accuracy,
    relaxed_correctness,
    vqa_accuracy,
)


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("Yes.", "yes"),
        ("The dog", "dog"),
        ("two dogs", "2 dogs"),
        ("None", "0"),
        ("dont know", "don't know"),
        ("isnt it", "isn't it"),
        ("3.5", "3.5"),  # a decimal point stays
        ("1,000", "1000"),  # a thousands comma goes
        ("left-hand", "left hand"),  # a hyphen inside a word becomes a space
        ("red , blue", "red blue"),  # punctuation next to a space goes
        ("  A\tcat\n", "cat"),
        ("'ow'sat", "'ow's'at"),  # the contraction table's entry (it mapped to itself here before)
        ("1,,000", "1000"),  # EvalAI's comma pattern takes a run of commas between digits
        ("." * 40 + "x", "." * 8 + "x"),  # re.UNICODE passed as sub()'s count: only 32 periods go
        ("e.g.", "eg"),
    ],
)
def test_vqa_normalisation(raw, normalised):
    assert normalize_vqa_answer(raw) == normalised


@pytest.mark.parametrize(
    "matching, expected",
    [
        # k of 10 annotators agree with the answer. An agreeing annotator's leave-one-out subset holds k-1
        # matches, a disagreeing one's k; each counts min(m/3, 1); the mean over the 10 subsets:
        (0, 0.0),
        (1, (1 * 0 + 9 * (1 / 3)) / 10),  # 0.3
        (2, (2 * (1 / 3) + 8 * (2 / 3)) / 10),  # 0.6
        (3, (3 * (2 / 3) + 7 * 1) / 10),  # 0.9
        (4, 1.0),
        (10, 1.0),
    ],
)
def test_vqa_accuracy_counts_annotators(matching, expected):
    refs = ["red"] * matching + ["blue"] * (10 - matching)
    assert vqa_accuracy("red", refs) == pytest.approx(expected)


def test_vqa_accuracy_normalises_both_sides():
    # "two", "2" and "2." are one answer after normalisation: 3 agreeing annotators -> 0.9
    refs = ["2", "two", "2."] + ["3"] * 7
    assert vqa_accuracy("Two", refs) == pytest.approx(0.9)
    assert vqa_accuracy("3", refs) == pytest.approx(1.0)
    assert vqa_accuracy("A dog.", ["dog"] * 10) == 1.0
    assert vqa_accuracy("Yes", ["yes"] * 10) == 1.0  # the official script would give 0 here (no normalisation)


def test_vqa_accuracy_is_lmms_evals_exact_mean():
    # statistics.mean (exact, then rounded once), not a float sum / 10, which depends on the annotators' order
    assert vqa_accuracy("red", ["blue"] * 8 + ["red"] * 2) == 0.6  # the float sum gives 0.5999999999999999
    assert vqa_accuracy("red", ["blue", "red", "blue", "red"] + ["blue"] * 5 + ["red"]) == 0.9  # 0.8999999999999998
    assert vqa_accuracy("red", ["red"] * 2 + ["blue"] * 8) == 0.6
    # equal strings are different annotators (VQAv2's answers carry distinct answer_ids)
    assert vqa_accuracy("yes", ["yes", "yes"]) == pytest.approx(1 / 3)


def test_vqa_accuracy_needs_references():
    with pytest.raises(ValueError):
        vqa_accuracy("yes", [])


@pytest.mark.parametrize(
    "prediction, target, ok",
    [
        ("10", "10.4", True),  # 3.8 % off
        ("10", "11", False),  # 9.1 % off
        ("95", "100", True),  # exactly 5 %
        ("94.9", "100", False),
        ("45%", "0.45", True),  # a percentage is read as a fraction
        ("0", "0", True),  # a zero target needs the exact string
        ("0.0", "0", False),
        ("Red", "red", True),
        ("reddish", "red", False),
    ],
)
def test_relaxed_correctness(prediction, target, ok):
    assert relaxed_correctness(prediction, target) is ok


@pytest.mark.parametrize(
    "prediction, target",
    [("1,000", "1000"), ("$5", "5"), ("5", "5%"), ("red", " red")],  # not numbers to float(); nothing stripped
)
def test_relaxed_correctness_is_pix2structs(prediction, target):
    assert relaxed_correctness(prediction, target) is False


def test_relaxed_accuracy_strips_nothing():
    # lmms-eval's relaxed_correctness strips neither side (its harness strips the generation before: tasks.score)
    assert relaxed_accuracy("  red\n", ["red"]) == 0.0
    assert relaxed_accuracy("red", ["red"]) == 1.0
    assert relaxed_accuracy("red", ["red "]) == 0.0
    assert relaxed_accuracy(" 10 ", ["10.4"]) == 1.0  # float() reads " 10 "
    assert relaxed_accuracy("10", [" 10 "]) == 1.0
    assert relaxed_accuracy(" 45%", ["0.45"]) == 1.0
    assert relaxed_accuracy("45% ", ["0.45"]) == 0.0  # not read as a percentage: "45% " does not end with "%"


def test_relaxed_accuracy_takes_any_label():
    assert relaxed_accuracy("7", ["seven", "7"]) == 1.0
    assert relaxed_accuracy("8", ["seven", "7"]) == 0.0


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0


@pytest.mark.parametrize(
    "prediction, refs, expected",
    [
        ("cat", ["cat"], 1.0),
        ("cats", ["cat"], 0.75),  # distance 1 over length 4
        ("ca", ["cat"], 1 - 1 / 3),
        ("c", ["cat"], 0.0),  # distance 2/3 >= 0.5
        ("abxx", ["abcd"], 0.5),  # a distance of exactly 0.5 is kept (the server script: score < 0.5 -> 0)
        ("ab", ["abcd"], 0.5),
        ("a", ["abc"], 0.0),  # 2/3
        ("abcx", ["abcd"], 0.75),
        ("dog", ["cat"], 0.0),
        ("colour", ["color", "colour"], 1.0),  # best reference
        ("  The  Cat ", ["the cat"], 1.0),  # case and whitespace
        ("x z", ["x    y"], 1 - 1 / 6),  # the distance is over normalised strings, the length over the raw ones
        ("straße", ["STRASSE"], 1 - 2 / 7),  # len("straße".upper()) == 7
        ("", [""], 1.0),
        ("", ["a"], 0.0),
        # the length is over the raw strings, whitespace included, on both sides (as lmms-eval's anls)
        ("ca  ", ["cat"], 0.75),  # distance 1 ("ca" to "cat") over length 4
        ("\t\tca", ["cat"], 0.75),
        ("ab\n", ["abcd"], 0.5),
        ("ab", ["abcd  "], 1 - 2 / 6),
        ("  ", ["a"], 0.5),  # distance 1 over length 2
    ],
)
def test_anls(prediction, refs, expected):
    assert anls(prediction, refs) == pytest.approx(expected)


def test_multiple_choice_accuracy():
    assert multiple_choice_accuracy(2, 2) == 1.0
    assert multiple_choice_accuracy(1, 2) == 0.0
    assert multiple_choice_accuracy(None, 0) == 0.0
