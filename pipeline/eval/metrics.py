"""The four benchmark metrics, one function per metric, each scoring one example in [0, 1].

Each equals lmms-eval's own function bit for bit on the text it is given, whitespace included: nothing is
stripped here that lmms-eval's function does not strip. lmms-eval's harness strips every generation before its
metric (``ConfigurableTask.process_results``); ``tasks.score`` takes that step, in lmms-eval's order, so a
model's raw generation is scored exactly as lmms-eval scores it. ``tests/test_lmms_eval_parity.py`` checks both
against lmms-eval's own code (see ``requirements-lmms.txt``):

- VQA accuracy (VQAv2): lmms-eval's ``vqav2_process_results``: EvalAI's answer normalisation (punctuation,
  number words, articles, contractions) on both sides, always, then the mean over the annotators of
  ``min(1, #other annotators giving the answer / 3)`` (``statistics.mean``).
- Relaxed accuracy (ChartQA): lmms-eval's ``relaxed_correctness`` (from Pix2Struct): a number (``%`` read as a
  fraction) within 5 % of a non-zero numeric label, otherwise a case-insensitive exact match; neither side is
  stripped (Python's ``float`` ignores surrounding whitespace, the exact match does not).
- ANLS (DocVQA): lmms-eval's ``anls`` (the DocVQA / InfographicVQA server script): ``1 - min`` over references of
  the normalised Levenshtein distance, 0 when that is below 0.5 (a distance of exactly 0.5 scores 0.5); the
  distance is between the stripped, lower-cased, whitespace-collapsed strings, the length is the longer of the
  raw (unstripped) prediction and reference.
- Multiple-choice accuracy (AI2D): the chosen option index (``extract.choice_index``, lmms-eval's filter and
  exact match) equals the answer index.

A task's score is the mean of its examples' scores.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

# --- VQA answer normalisation (EvalAIAnswerProcessor, lmms_eval/tasks/_task_utils/vqa_eval_metric.py, itself
# the tables of the official VQA evaluation script vqaEval.py) ---

_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've",
    "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at",
    "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd",
    "someoned've": "someone'd've", "someone'dve": "someone'd've", "someonell": "someone'll",
    "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's", "thered": "there'd",
    "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're", "theres": "there's",
    "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've", "theyll": "they'll",
    "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't", "wed've": "we'd've",
    "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll", "whatre": "what're",
    "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd", "wheres": "where's",
    "whereve": "where've", "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've", "wholl": "who'll",
    "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's", "wont": "won't",
    "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've",
    "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll", "yall'd've": "y'all'd've",
    "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd", "youd've": "you'd've",
    "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}
_NUMBER_WORDS = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
    "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}
_ARTICLES = {"a", "an", "the"}
_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
# Both patterns as in lmms-eval, typos included: the look-behind "(?!<=" is not one (any period not followed by a
# digit goes), and its sub() gets re.UNICODE (32) as its *count*, so at most 32 such periods are removed.
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_PERIOD_STRIP_COUNT = int(re.UNICODE)
_COMMA_STRIP = re.compile(r"(?<=\d)(\,)+(?=\d)")  # mmf / EvalAI's; the official script has (\d)(\,)(\d)


def _process_punctuation(text: str) -> str:
    out = text
    for p in _PUNCT:
        if (p + " " in text or " " + p in text) or _COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_STRIP.sub("", out, count=_PERIOD_STRIP_COUNT)


def _process_digit_article(text: str) -> str:
    words = [_NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [w for w in words if w not in _ARTICLES]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words)


def normalize_vqa_answer(text: str) -> str:
    """lmms-eval's VQAv2 answer normalisation: tabs and newlines to spaces, strip, punctuation, lower case,
    number words, articles, contractions."""
    text = text.replace("\n", " ").replace("\t", " ").strip()
    return _process_digit_article(_process_punctuation(text))


def vqa_accuracy(prediction: str, references: Sequence[str]) -> float:
    """VQA accuracy of one answer against the (normally ten) annotators' answers, as lmms-eval computes it.

    For each annotator, ``min(1, #other annotators giving the predicted answer / 3)``; the mean over the
    annotators (``statistics.mean``, exact). Each reference is one annotator (VQAv2's answers carry distinct
    ``answer_id``s), so equal strings are still different annotators. Both sides are always normalised (the
    official script only normalises when the annotators disagree, so "Yes" would score 0 there against ten
    "yes").
    """
    if not references:
        raise ValueError("vqa_accuracy: no reference answers")
    pred = normalize_vqa_answer(prediction)
    refs = [normalize_vqa_answer(r) for r in references]
    accs = []
    for i in range(len(refs)):
        matches = sum(1 for j, r in enumerate(refs) if j != i and r == pred)
        accs.append(min(1, float(matches) / 3))
    return float(statistics.mean(accs))


# --- ChartQA relaxed accuracy (lmms-eval's chartqa utils, from Qwen-VL, from Pix2Struct) ---


def _to_float(text: str) -> float | None:
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_correctness(prediction: str, target: str, max_relative_change: float = 0.05) -> bool:
    """A numeric prediction within ``max_relative_change`` of a non-zero numeric target; otherwise a
    case-insensitive exact match (a target of 0 also needs the exact string). Nothing is stripped here; a
    trailing "%" divides by 100, Python's ``float`` reads the rest ("1,000" and "$5" are not numbers)."""
    p, t = _to_float(prediction), _to_float(target)
    if p is not None and t:
        return abs(p - t) / abs(t) <= max_relative_change
    return prediction.lower() == target.lower()


def relaxed_accuracy(prediction: str, references: Sequence[str], max_relative_change: float = 0.05) -> float:
    """1.0 if the prediction, as given (not stripped), is relaxed-correct against any reference (lmms-eval's
    ChartQA has one label per question; with one reference this is exactly its ``relaxed_correctness``)."""
    if not references:
        raise ValueError("relaxed_accuracy: no reference answers")
    return float(any(relaxed_correctness(prediction, r, max_relative_change) for r in references))


# --- DocVQA ANLS (lmms_eval/api/metrics.py anls, the DocVQA / InfographicVQA server script) ---


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _anls_normalize(text: str) -> str:
    return " ".join(text.strip().lower().split())


def anls(prediction: str, references: Sequence[str], threshold: float = 0.5) -> float:
    """Average Normalised Levenshtein Similarity of one answer, as the DocVQA server script and lmms-eval compute
    it: ``1 - min`` over references of ``dist / length``, with ``dist`` between the lower-cased,
    whitespace-collapsed strings and ``length`` the longer of the two *raw* strings (``len(s.upper())``, the
    prediction as given, not stripped); a score below ``threshold`` counts 0 (a normalised distance of exactly
    0.5 scores 0.5)."""
    if not references:
        raise ValueError("anls: no reference answers")
    pred = _anls_normalize(prediction)
    values = []
    for ref in references:
        distance = levenshtein(_anls_normalize(ref), pred)
        length = max(len(ref.upper()), len(prediction.upper()))
        values.append(0.0 if length == 0 else float(distance) / float(length))
    score = 1 - min(values)
    return 0.0 if score < threshold else float(score)


# --- AI2D multiple choice ---


def multiple_choice_accuracy(choice: int | None, answer: int) -> float:
    """1.0 when the extracted option index equals the answer index (no extractable choice scores 0)."""
    return float(choice is not None and choice == answer)
