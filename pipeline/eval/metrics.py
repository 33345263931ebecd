"""The four benchmark metrics, one function per metric, each scoring one example in [0, 1].

- VQA accuracy (VQAv2): the official VQA evaluation's answer normalisation and its leave-one-annotator-out
  average of ``min(#matches / 3, 1)``.
- Relaxed accuracy (ChartQA): a number within 5 % of the label, otherwise a case-insensitive exact match.
- ANLS (DocVQA): ``1 - normalised Levenshtein distance`` when below the 0.5 threshold, maximum over references.
- Multiple-choice accuracy (AI2D): the chosen option index equals the answer index.

A task's score is the mean of its examples' scores.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# --- VQA answer normalisation (the tables of the official VQA evaluation script, vqaEval.py) ---

_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd",
    "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've", "Im": "I'm", "Ive": "I've",
    "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll", "let's": "let's",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow'sat",
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
# The official pattern (with its look-behind typo "(?!<=" kept): a period not followed by a digit.
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")


def _process_punctuation(text: str) -> str:
    out = text
    for p in _PUNCT:
        if (p + " " in text or " " + p in text) or _COMMA_STRIP.search(text) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_STRIP.sub("", out)


def _process_digit_article(text: str) -> str:
    words = [_NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [w for w in words if w not in _ARTICLES]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words)


def normalize_vqa_answer(text: str) -> str:
    """The official VQA answer normalisation: whitespace, punctuation, lower case, number words, articles,
    contractions."""
    text = text.replace("\n", " ").replace("\t", " ").strip()
    return _process_digit_article(_process_punctuation(text))


def vqa_accuracy(prediction: str, references: Sequence[str]) -> float:
    """VQA accuracy of one answer against the (normally ten) annotators' answers.

    For each annotator, ``min(#other annotators giving the predicted answer / 3, 1)``; the mean over the
    annotators (the official average over the 10 choose 9 subsets). Unlike the official script, which only
    normalises when the annotators disagree, both sides are always normalised, as the EvalAI server does for
    submitted answers (otherwise "Yes" scores 0 against ten "yes").
    """
    if not references:
        raise ValueError("vqa_accuracy: no reference answers")
    pred = normalize_vqa_answer(prediction)
    refs = [normalize_vqa_answer(r) for r in references]
    total = 0.0
    for i in range(len(refs)):
        matches = sum(1 for j, r in enumerate(refs) if j != i and r == pred)
        total += min(1.0, matches / 3.0)
    return total / len(refs)


# --- ChartQA relaxed accuracy (as in the ChartQA / Pix2Struct evaluation code) ---


def _to_float(text: str) -> float | None:
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_correctness(prediction: str, target: str, max_relative_change: float = 0.05) -> bool:
    """A numeric prediction within ``max_relative_change`` of a non-zero numeric target; otherwise a
    case-insensitive exact match (a target of 0 also needs the exact string)."""
    prediction, target = prediction.strip(), target.strip()
    p, t = _to_float(prediction), _to_float(target)
    if p is not None and t:
        return abs(p - t) / abs(t) <= max_relative_change
    return prediction.lower() == target.lower()


def relaxed_accuracy(prediction: str, references: Sequence[str], max_relative_change: float = 0.05) -> float:
    """1.0 if the prediction is relaxed-correct against any reference (ChartQA labels are lists)."""
    if not references:
        raise ValueError("relaxed_accuracy: no reference answers")
    return float(any(relaxed_correctness(prediction, r, max_relative_change) for r in references))


# --- DocVQA ANLS ---


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
    """Average Normalised Levenshtein Similarity of one answer: the maximum over references of
    ``1 - dist / max(len)``, counted as 0 when the normalised distance is at least ``threshold``."""
    if not references:
        raise ValueError("anls: no reference answers")
    pred = _anls_normalize(prediction)
    best = 0.0
    for ref in references:
        ref = _anls_normalize(ref)
        length = max(len(pred), len(ref))
        distance = levenshtein(pred, ref) / length if length else 0.0
        best = max(best, 1.0 - distance if distance < threshold else 0.0)
    return best


# --- AI2D multiple choice ---


def multiple_choice_accuracy(choice: int | None, answer: int) -> float:
    """1.0 when the extracted option index equals the answer index (no extractable choice scores 0)."""
    return float(choice is not None and choice == answer)
