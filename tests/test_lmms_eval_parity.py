"""Our four metrics against lmms-eval's own scoring code, bit for bit, on the same generations.

lmms-eval is the harness the field reports VLM numbers with. Two levels are compared:

- a raw generation (as lmms-eval's Llama 3.2 Vision wrapper decodes it: nothing stripped) scored by
  ``tasks.score`` against lmms-eval's code path for one generation: its filters (AI2D), then
  ``ConfigurableTask.process_results`` (which strips every generation, then calls the task's
  ``process_results`` or its registered metric with the task YAML's keyword arguments) and the metric itself;
- each metric function (``vqa_accuracy``, ``relaxed_accuracy``, ``anls``, ``choice_index``) against lmms-eval's
  own function on exactly the same text, whitespace included (leading and trailing spaces, newlines, tabs on
  both the prediction and the references): nothing is stripped that lmms-eval's function does not strip.

Needs lmms-eval installed without its dependencies:

    .venv/bin/pip install --no-deps -r requirements-lmms.txt
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

INSTALL = ".venv/bin/pip install --no-deps -r requirements-lmms.txt"

try:
    from lmms_eval.api import metrics as _lmms_metrics  # noqa: F401  (registers the metrics)
    from lmms_eval.api.registry import METRIC_REGISTRY
    from lmms_eval.api.task import ConfigurableTask
    from lmms_eval.tasks.ai2d import utils as ai2d_utils
    from lmms_eval.tasks.chartqa import utils as chartqa_utils
    from lmms_eval.tasks.vqav2 import utils as vqav2_utils
except ImportError as e:  # CI installs it; a plain checkout need not
    pytest.skip(f"lmms-eval is not importable ({e}); install it with: {INSTALL}", allow_module_level=True)

from pipeline.eval import extract
from pipeline.eval.extract import choice_index
from pipeline.eval.metrics import anls, multiple_choice_accuracy, relaxed_accuracy, vqa_accuracy
from pipeline.eval.task_prompts import option_letter
from pipeline.eval.tasks import EvalExample, score

MIN_CASES = 300  # per metric


# --- lmms-eval's scoring of one generation ---------------------------------------------------------------


def _task_yaml(task_dir: str, name: str) -> dict:
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return yaml.load((Path(ai2d_utils.__file__).parent.parent / task_dir / name).read_text(), Loader=Loader)


def _process_results(doc: dict, generation: str, *, callback=None, target=None, metric=None, kwargs=None) -> dict:
    """lmms-eval's ConfigurableTask.process_results (generate_until) on a stand-in task object."""
    task = SimpleNamespace(
        OUTPUT_TYPE="generate_until",
        config=SimpleNamespace(process_results=callback, doc_to_choice=None),
        doc_to_target=lambda d: target,
        multiple_target=len(target) if isinstance(target, list) else 0,
        _metric_fn_list={} if metric is None else {metric: METRIC_REGISTRY[metric]},
        _metric_fn_kwargs={} if metric is None else {metric: kwargs or {}},
    )
    return ConfigurableTask.process_results(task, doc, [generation])


def lmms_vqav2(generation: str, references: list[str]) -> float:
    # VQAv2's answers are dicts with distinct answer_ids: one per annotator
    answers = [{"answer": r, "answer_confidence": "yes", "answer_id": i + 1} for i, r in enumerate(references)]
    doc = {"question_id": 1, "question": "q", "answers": copy.deepcopy(answers)}
    return _process_results(doc, generation, callback=vqav2_utils.vqav2_process_results_val)["exact_match"]


def lmms_chartqa(generation: str, label: str) -> float:
    doc = {"type": "human_test", "question": "q", "answer": label}
    return _process_results(doc, generation, callback=chartqa_utils.chartqa_process_results)["relaxed_overall"]


DOCVQA_METRICS = _task_yaml("docvqa", "docvqa_val.yaml")["metric_list"]


def lmms_docvqa(generation: str, answers: list[str]) -> float:
    assert [m["metric"] for m in DOCVQA_METRICS] == ["anls"]
    doc = {"questionId": 1, "question": "q", "answers": list(answers)}
    return _process_results(doc, generation, target=list(answers), metric="anls")["anls"]


AI2D = _task_yaml("ai2d", "ai2d.yaml")


def _ai2d_filter():
    (ensemble,) = AI2D["filter_list"]
    (component,) = ensemble["filter"]
    assert component["function"] == "utils.MultiChoiceRegexFilter"
    return ai2d_utils.MultiChoiceRegexFilter(**{k: v for k, v in component.items() if k != "function"})


AI2D_FILTER = _ai2d_filter()
(_AI2D_METRIC,) = AI2D["metric_list"]
AI2D_METRIC_KWARGS = {k: v for k, v in _AI2D_METRIC.items() if k not in ("metric", "aggregation", "higher_is_better")}


def lmms_ai2d(generation: str, options: list[str], answer: int) -> float:
    doc = {"question": "q", "options": list(options), "answer": str(answer)}
    (filtered,) = AI2D_FILTER.apply([[generation]], [doc])
    target = ai2d_utils.ai2d_doc_to_target(doc, AI2D["model_specific_target_kwargs"]["default"])
    return float(_process_results(doc, filtered, target=target, metric=_AI2D_METRIC["metric"],
                                  kwargs=AI2D_METRIC_KWARGS)["exact_match"])


# --- cases -----------------------------------------------------------------------------------------------

UNICODE = ["café", "Café", "CAFÉ", "naïve", "straße", "STRASSE", "ﬁsh", "İstanbul", "ＹＥＳ", "日本", "ß", "Σίσυφος", "١٢"]

VQA_WORDS = [
    "yes", "Yes", "YES", "no", "No.", "two", "Two", "2", "2.", "ten", "10", "none", "zero", "0", "eleven", "one",
    "the", "The", "a", "A", "an", "An", "dog", "dogs", "red", "Red", "blue", "left-hand", "left", "hand",
    "dont", "don't", "isnt", "isn't", "Im", "I'm", "'ow'sat", "'ow's'at", "ow's'at", "yall'll", "whats", "what's",
    "1,000", "1000", "1,,000", "3.5", "3.", ".5", "e.g.", "a.b.c", "U.S.A.", "(red)", "[red]", "red,", "red;",
    "red?", "red!", "\"red\"", "`red`", "red/blue", "red+blue", "x=y", "a_b", "@home", "<b>", "$5", "50%", "#1",
    "it's", "'s", "...", "-", ",", "?", "", *UNICODE,
]
SEPARATORS = [" ", " ", " ", "", "  ", ", ", " , ", "-", "\n", "\t", ". "]


def _phrase(rng: random.Random, words: list[str], max_words: int = 3) -> str:
    n = rng.randint(1, max_words)
    out = rng.choice(words)
    for _ in range(n - 1):
        out += rng.choice(SEPARATORS) + rng.choice(words)
    return rng.choice(["", "", "", " ", "\n", "  "]) + out + rng.choice(["", "", "", ".", " ", "\n", "!"])


VQA_HAND = [
    ("Yes.", ["yes"] * 10), ("yes", ["Yes"] * 10), ("The dog", ["dog"] * 10), ("two dogs", ["2 dogs"] * 10),
    ("None", ["0"] * 3 + ["none"] * 7), ("dont know", ["don't know"] * 10), ("isnt it", ["isn't it"] * 4),
    ("'ow'sat", ["'ow's'at"] * 10), ("'ow's'at", ["'ow'sat"] * 10), ("3.5", ["3.5", "3,5", "35"] * 3 + ["3.5"]),
    ("1,000", ["1000"] * 10), ("1,,000", ["1000"] * 10), ("left-hand", ["left hand"] * 10),
    ("red , blue", ["red blue"] * 10), ("  A\tcat\n", ["cat"] * 10), ("red\nbecause it is", ["red"] * 10),
    ("." * 40 + "x", ["x"] * 10), ("a" + ". a" * 40, ["a"] * 10), ("e.g.", ["eg"] * 10), ("U.S.A.", ["usa"] * 10),
    ("", [""] * 10), ("", ["yes"] * 10), ("café", ["Café"] * 10), ("ＹＥＳ", ["yes"] * 10), ("straße", ["STRASSE"] * 10),
    ("Two", ["2", "two", "2."] + ["3"] * 7), ("3", ["2", "two", "2."] + ["3"] * 7),
    *[("red", ["red"] * k + ["blue"] * (10 - k)) for k in range(11)],
    ("yes", ["yes"]), ("yes", ["yes", "yes"]), ("yes", ["yes", "no", "yes"]), ("yes", ["no"] * 9), ("yes", ["yes"] * 12),
]


def vqa_cases() -> list[tuple[str, list[str]]]:
    rng = random.Random(0)
    cases = list(VQA_HAND)
    while len(cases) < 400:
        pred = _phrase(rng, VQA_WORDS)
        n = rng.choice([10, 10, 10, 1, 3, 5, 9])
        variants = [pred, pred.lower(), pred.upper(), pred.strip(" .\n"), "the " + pred, pred + ".", pred.replace(" ", "-")]
        refs = [rng.choice(variants) if rng.random() < rng.random() else _phrase(rng, VQA_WORDS, 2) for _ in range(n)]
        cases.append((pred, refs))
    return cases


CHART_HAND = [
    ("10", "10.4"), ("10", "11"), ("95", "100"), ("94.9", "100"), ("105", "100"), ("105.01", "100"), ("4.75", "5"),
    ("5.25", "5"), ("0.95", "1"), ("1.05", "1"), ("-95", "-100"), ("95", "-100"), ("45%", "0.45"), ("45", "45%"),
    ("0.45", "45%"), ("45 %", "45%"), ("45%", "45"), ("0", "0"), ("0.0", "0"), ("0", "0.0"), ("0.001", "0"),
    ("Red", "red"), ("reddish", "red"), (" red", "red"), ("red ", "red"), ("red", " red"), ("red", "red "),
    (" 10 ", "10"), ("10", " 10"), ("10", "10\n"), ("1,000", "1000"), ("1000", "1,000"), ("1,000", "1,000"),
    ("$5", "5"), ("5", "$5"), ("$5", "$5"), ("€5", "5"), ("5 dollars", "5"), ("1e3", "1000"), ("1_000", "1000"),
    ("nan", "nan"), ("inf", "inf"), ("NaN", "nan"), ("infinity", "1e400"), ("٥", "5"), ("5", "٥"), ("", ""),
    ("", "0"), ("0", ""), ("%", "%"), ("5%%", "0.05"), ("5", "5%"), ("100%", "1"), ("1", "100%"), ("1.0", "1"),
    ("Yes", "yes"), ("YES", "Yes"), ("straße", "STRASSE"), ("İ", "i̇"), ("10\n", "10"), ("FINAL ANSWER: 10", "10"),
]


def chartqa_cases() -> list[tuple[str, list[str]]]:
    rng = random.Random(1)
    cases = [(p, [t]) for p, t in CHART_HAND]
    fmts = [lambda v: f"{v:g}", lambda v: f"{v:.1f}", lambda v: f"{v:.2f}", lambda v: f"{v:.3f}", lambda v: f"{v:,.0f}",
            lambda v: f"{v * 100:g}%", lambda v: f"{v:g}%", lambda v: f"${v:g}", lambda v: f" {v:g} ", lambda v: str(int(v))]
    while len(cases) < 400:
        t = rng.choice([rng.randint(-50, 50), rng.uniform(-1000, 1000), rng.randint(1, 10**6), rng.uniform(0, 1), 0.0, 100.0])
        factor = rng.choice([1.0, 0.95, 1.05, 0.9499, 1.0501, 0.95 + 1e-12, 1.05 - 1e-12, rng.uniform(0.9, 1.1)])
        p = t * factor
        pred, label = rng.choice(fmts)(p), rng.choice(fmts)(t)
        refs = [label] if rng.random() < 0.8 else [label, rng.choice(fmts)(t * rng.uniform(0.8, 1.2))]
        cases.append((pred, refs))
    return cases


DOC_HAND = [
    ("cat", ["cat"]), ("cats", ["cat"]), ("ca", ["cat"]), ("c", ["cat"]), ("abxx", ["abcd"]), ("ab", ["abcd"]),
    ("abcdef", ["abc"]), ("abcx", ["abcd"]), ("dog", ["cat"]), ("colour", ["color", "colour"]), ("  The  Cat ", ["the cat"]),
    ("x z", ["x    y"]), ("x    z", ["x y"]), ("The Cat", ["the  cat"]), ("straße", ["STRASSE"]), ("strasse", ["straße"]),
    ("ﬁsh", ["fish"]), ("İstanbul", ["istanbul"]), ("", [""]), ("", ["a"]), ("a", [""]), ("   ", [""]), ("", ["", "x"]),
    ("x", ["x", "x"]), ("xy", ["x", "x", "xyz"]), ("abcd", ["ab", "abcdefgh"]), ("ABCD", ["abxx"]),
    ("1,000", ["1000"]), ("$5", ["5"]), ("lamp\"", ["lamp"]), ("'key'", ["key"]), ("Memo", ["memo:"]),
    ("Memo", ["Me"]), ("12/05/1998", ["12.05.1998", "12-05-1998"]), ("日本語", ["日本"]), ("a\nb", ["a b"]),
]


def docvqa_cases() -> list[tuple[str, list[str]]]:
    rng = random.Random(2)
    cases = list(DOC_HAND)
    alphabet = "abcdeABCDE  .,-:'\"\n\tßﬁİé0123"
    while len(cases) < 400:
        base = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        refs = []
        for _ in range(rng.choice([1, 1, 2, 3])):
            r = list(base)
            for _ in range(rng.randint(0, 6)):  # edits
                op = rng.random()
                if op < 0.4 and r:
                    r[rng.randrange(len(r))] = rng.choice(alphabet)
                elif op < 0.7:
                    r.insert(rng.randint(0, len(r)), rng.choice(alphabet))
                elif r:
                    del r[rng.randrange(len(r))]
            refs.append("".join(r))
        if rng.random() < 0.1:
            refs.append(refs[0])  # a duplicate
        cases.append((base, refs))
    # exact 0.5 boundaries: half the characters changed
    for n in range(1, 9):
        cases.append(("a" * n + "b" * n, ["a" * (2 * n)]))
        cases.append(("a" * n, ["a" * (2 * n)]))
        cases.append(("a" * n + "b" * (n + 1), ["a" * (2 * n + 1)]))
    return cases


AI2D_HAND = [
    "A", "B", "C", "D", "E", "Z", "a", "b", "d", "(B)", "B)", "B.", "B. circle", " B.", "  C. square", "B circle",
    "b. circle", "**B**", "B\n", "\nB", "B\n\nbecause", "The answer is D.", "FINAL ANSWER: A", "Answer: B", "2", "3",
    "circle", "square", "Square.", "It is the triangle, I think", "A or C", "A, C", "A/C", "A and C", "B.C", "AB",
    "A.B.", "", "   ", ".", "B:", "B -", "'B'", "\"C\"", "[D]", "{A}", "<B>", "B!", "B?", "B。", "Ｂ", "B\x00",
    "B.\x00", "\u212a", "İ", "Option B", "(b)", "B. ", "B .", "B\t.", "\tA.", "\u00a0B.", "B\u00a0", "e", "E.",
]


def ai2d_cases() -> list[tuple[str, list[str]]]:
    rng = random.Random(3)
    option_sets = [["circle", "square", "triangle", "star"], ["4", "3", "2", "1"], ["yes", "no"],
                   [f"o{i}" for i in range(6)], [f"o{i}" for i in range(12)], [f"o{i}" for i in range(26)]]
    cases = [(r, opts) for r in AI2D_HAND for opts in option_sets[:2]]
    cases += [(r, option_sets[4]) for r in ["K", "k", "\u212a", "I", "i", "İ", "L.", "l."]]
    prefixes = ["", "", " ", "(", "**", "Answer: ", "The answer is ", "FINAL ANSWER: ", "\n", "Option "]
    suffixes = ["", "", ".", ")", "**", ". circle", " circle", ".\n", "\nbecause", ",", " or C"]
    while len(cases) < 400:
        opts = rng.choice(option_sets)
        letter = chr(ord("A") + rng.randrange(len(opts) + 1))
        letter = letter.lower() if rng.random() < 0.2 else letter
        cases.append((rng.choice(prefixes) + letter + rng.choice(suffixes), opts))
    return cases


# --- whitespace around predictions and references ----------------------------------------------------------

WHITESPACE = ["", " ", "  ", "\n", "\t", "\n\n", " \n", "\t \n", "\r\n"]


def _wrap(rng: random.Random, text: str) -> str:
    return rng.choice(WHITESPACE) + text + rng.choice(WHITESPACE)


def whitespace_cases(cases: list[tuple[str, list]], seed: int, refs_too: bool = True) -> list[tuple[str, list]]:
    """Every case once more with whitespace before and after the prediction and, with ``refs_too``, around
    some of its references; at least one side has some."""
    rng = random.Random(seed)
    out = []
    for pred, refs in cases:
        while True:
            p = _wrap(rng, pred)
            r = [_wrap(rng, x) if refs_too and rng.random() < 0.5 else x for x in refs]
            if (p, r) != (pred, list(refs)):
                break
        out.append((p, r))
    return out


def _example(family: str, references=(), options=None, answer_index=None) -> EvalExample:
    return EvalExample(f"parity-{family}", "0", None, "q", "q", tuple(references),
                       None if options is None else tuple(options), answer_index)


# --- the comparisons: a raw generation scored as lmms-eval's harness scores it -----------------------------


def _same(ours: float, theirs: float) -> bool:
    return type(ours) is float and ours == float(theirs) and ours.hex() == float(theirs).hex()


def test_vqav2_accuracy_equals_lmms_eval():
    cases = vqa_cases()
    cases += whitespace_cases(cases[:150], seed=10)
    assert len(cases) >= MIN_CASES
    bad = []
    for generation, refs in cases:
        ours, theirs = score("vqa", _example("vqa", refs), generation)[1], lmms_vqav2(generation, refs)
        if not _same(ours, theirs):
            bad.append((generation, refs, ours, theirs))
    assert not bad, bad[:5]


def test_chartqa_relaxed_accuracy_equals_lmms_eval():
    cases = chartqa_cases()
    cases += whitespace_cases(cases[:150], seed=11)
    cases += [("FINAL ANSWER: 10", ["10"]), ("The bar.\nFINAL ANSWER:  red \n", ["red"]),
              ("final answer:\n\t45%\nmore", ["0.45"]), ("FINAL ANSWER: 10.", ["10"]), ('FINAL ANSWER: "red"', ["red"])]
    assert len(cases) >= MIN_CASES
    bad = []
    for generation, labels in cases:
        # lmms-eval's harness on the SPEC's answer line (the whole generation without a "FINAL ANSWER:"
        # marker); lmms-eval's ChartQA has one label, with more the score is the best over labels (Pix2Struct's)
        answer = extract.final_answer_line(generation)
        ours = score("chartqa", _example("chartqa", labels), generation)[1]
        theirs = max(lmms_chartqa(answer, t) for t in labels)
        if not _same(ours, theirs):
            bad.append((generation, labels, ours, theirs))
    assert not bad, bad[:5]
    assert sum(score("chartqa", _example("chartqa", t), g)[1] for g, t in cases) > 100  # not all zeros


def test_docvqa_anls_equals_lmms_eval():
    cases = docvqa_cases()
    cases += whitespace_cases(cases[:150], seed=12)
    assert len(cases) >= MIN_CASES
    bad = []
    for generation, answers in cases:
        ours, theirs = score("docvqa", _example("docvqa", answers), generation)[1], lmms_docvqa(generation, answers)
        if not _same(ours, theirs):
            bad.append((generation, answers, ours, theirs))
    assert not bad, bad[:5]
    assert any(anls(g, a) == 0.5 for g, a in cases)  # the boundary is exercised


def test_ai2d_accuracy_equals_lmms_eval():
    cases = ai2d_cases()
    cases += whitespace_cases(cases[:150], seed=13, refs_too=False)
    assert len(cases) >= MIN_CASES
    bad, picked = [], 0
    for generation, options in cases:
        lmms_scores = [lmms_ai2d(generation, options, k) for k in range(len(options))]
        # the option lmms-eval counts correct, if any (option letters are distinct for up to 26 options)
        assert sum(lmms_scores) <= 1
        lmms_choice = lmms_scores.index(1.0) if 1.0 in lmms_scores else None
        scored = [score("ai2d", _example("ai2d", [option_letter(k)], options, k), generation)
                  for k in range(len(options))]
        letters = {letter for letter, _ in scored}
        assert len(letters) == 1
        (letter,) = letters
        choice = None if letter == "" else ord(letter) - ord("A")
        picked += choice is not None
        if choice != lmms_choice or any(not _same(s, t) for (_, s), t in zip(scored, lmms_scores)):
            bad.append((generation, options, choice, lmms_choice))
    assert not bad, bad[:5]
    assert 50 < picked < len(cases) - 50  # both outcomes exercised


# --- the comparisons: each metric function against lmms-eval's own function on the same text ---------------
# No harness strip here: lmms-eval's functions see the text as given, so ours must too (" red" is not "red" to
# ChartQA's exact match; ANLS divides by the raw lengths; AI2D's exact match keeps the filter's whitespace).


def _some_differ(cases, strip_differs) -> None:
    """The whitespace cases include ones where stripping the prediction would change lmms-eval's score."""
    assert sum(map(strip_differs, cases)) >= 10


def test_vqa_accuracy_is_lmms_evals_function_on_the_same_text():
    cases = whitespace_cases(vqa_cases(), seed=20)
    bad = []
    for pred, refs in cases:
        answers = [{"answer": r, "answer_confidence": "yes", "answer_id": i + 1} for i, r in enumerate(refs)]
        theirs = vqav2_utils.vqav2_process_results_val({"question_id": 1, "answers": answers}, [pred])["exact_match"]
        ours = vqa_accuracy(pred, refs)
        if not _same(ours, theirs):
            bad.append((pred, refs, ours, theirs))
    assert not bad, bad[:5]


def test_relaxed_accuracy_is_lmms_evals_function_on_the_same_text():
    cases = whitespace_cases(chartqa_cases(), seed=21)
    cases += [(" red", ["red"]), ("red\n", ["red"]), ("\tred", ["red"]), ("red", ["red "]), (" 10 ", ["10.4"]),
              ("\n10\t", ["10"]), ("10", [" 10\n"]), (" 45%", ["0.45"]), ("45% ", ["0.45"]), (" Yes", ["yes"])]
    bad = []
    for pred, labels in cases:
        theirs = float(any(chartqa_utils.relaxed_correctness(pred, t) for t in labels))
        ours = relaxed_accuracy(pred, labels)
        if not _same(ours, theirs):
            bad.append((pred, labels, ours, theirs))
    assert not bad, bad[:5]
    _some_differ(cases, lambda c: any(chartqa_utils.relaxed_correctness(c[0].strip(), t) for t in c[1])
                 != any(chartqa_utils.relaxed_correctness(c[0], t) for t in c[1]))


def test_anls_is_lmms_evals_function_on_the_same_text():
    cases = whitespace_cases(docvqa_cases(), seed=22)
    cases += [("ca  ", ["cat"]), ("\tca", ["cat"]), ("cat\n", ["cats"]), ("ab", ["abcd  "]), (" ab\n", ["abcd"]),
              ("a\tb", ["a b"]), ("  ", ["a"]), ("x", ["\n"])]
    bad = []
    for pred, answers in cases:
        theirs = _lmms_metrics.anls(references=list(answers), predictions=[pred])["anls"]
        ours = anls(pred, answers)
        if not _same(ours, theirs):
            bad.append((pred, answers, ours, theirs))
    assert not bad, bad[:5]
    _some_differ(cases, lambda c: _lmms_metrics.anls(references=c[1], predictions=[c[0].strip()])["anls"]
                 != _lmms_metrics.anls(references=c[1], predictions=[c[0]])["anls"])


def test_choice_index_is_lmms_evals_filter_and_exact_match_on_the_same_text():
    cases = whitespace_cases(ai2d_cases(), seed=23, refs_too=False)
    cases += [(" B", ["a", "b", "c"]), ("B\n", ["a", "b", "c"]), ("\tB", ["a", "b", "c"]), ("B ", ["a", "b", "c"]),
              ("\n C. c", ["a", "b", "c"]), (" (A) ", ["a", "b"])]
    bad = []
    for response, options in cases:
        (filtered,) = AI2D_FILTER.apply([[response]], [{"options": options}])
        metric = METRIC_REGISTRY[_AI2D_METRIC["metric"]]
        theirs = [metric(predictions=[filtered], references=[option_letter(k)], **AI2D_METRIC_KWARGS)["exact_match"]
                  for k in range(len(options))]
        lmms_choice = theirs.index(1.0) if 1.0 in theirs else None
        ours = choice_index(response, options)
        if ours != lmms_choice:
            bad.append((response, options, ours, lmms_choice))
    assert not bad, bad[:5]
    strip_choice = lambda c: choice_index(c[0].strip(), c[1])  # noqa: E731
    _some_differ(cases, lambda c: strip_choice(c) != choice_index(c[0], c[1]))
