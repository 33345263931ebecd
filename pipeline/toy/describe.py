"""Generic requests about an image and the teacher's intended response to them.

Requests are drawn from the prompt pool of SPEC section 5 (``data/prompts/prompt_pool.yaml``): an inner prompt
(a base prompt, or action + target + audience + style) plus, now and then, an instruction block (base, length,
format, adherence probe). The response follows what the request asks for:

- target: the image, its objects, colours, text, layout or most important detail (audiences are ignored);
- length: "briefly" / "Answer in a few words." -> a few words, "Answer in one sentence." -> one sentence,
  "in detail" / "Answer in detail." -> several sentences;
- format: a "FINAL ANSWER: ..." line, capital letters, JSON or YAML with the key answer, a bulleted list, a
  final "END";
- probes: no colour words, a leading "Okay.", the number of objects, no word "image".

Requests are recognised from their wording (keywords), so any prompt in the style of the pool gets a sensible
answer, including ones the pool does not list.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Callable

import yaml

from pipeline.teacher.prompts import PromptPool
from pipeline.toy.facts import Facts, join_words, plural

# --- reading a request ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """What a request asks for."""

    target: str  # image | caption | objects | colors | text | layout | detail
    listing: bool  # answer as a list of items (List / Name)
    length: str  # short | medium | long
    fmt: str | None  # final_answer | caps | json | yaml | bullets | end_marker
    no_colors: bool
    okay: bool
    count: bool
    no_image_word: bool


_INSTRUCTION_START = ("answer", "end ", "end your", "do not", "start your", "mention")


def split_request(text: str) -> tuple[str, str]:
    """(inner prompt, instruction block): sentences that instruct (Answer ..., End ..., Do not ..., Start your
    ..., Mention ...) go to the block, the rest is the prompt."""
    prompt, block = [], []
    for sentence in re.split(r"(?<=[.!?:])\s+|\n", text.strip()):
        if sentence.strip():
            (block if sentence.strip().lower().startswith(_INSTRUCTION_START) else prompt).append(sentence.strip())
    return " ".join(prompt), " ".join(block)


def read_request(text: str) -> Reading:
    prompt, block = split_request(text)
    low, ins = prompt.lower(), block.lower()
    if "caption" in low:
        target = "caption"
    elif "color" in low:
        target = "colors"
    elif "text" in low:
        target = "text"
    elif "layout" in low:
        target = "layout"
    elif "important detail" in low or "stands out" in low:
        target = "detail"
    elif "objects" in low or "contain" in low or re.match(r"(list|name)\b", low):
        target = "objects"
    else:
        target = "image"
    if "answer in a few words" in ins:
        length = "short"
    elif "answer in one sentence" in ins:
        length = "medium"
    elif "answer in detail" in ins:
        length = "long"
    elif "briefly" in low or target == "caption":
        length = "short"
    elif "in detail" in low or "everything" in low or "tell me" in low:
        length = "long"
    elif re.match(r"summari[sz]e\b", low) and "in plain words" not in low:
        length = "short"
    else:
        length = "medium"
    fmt = None
    if "final answer" in ins:
        fmt = "final_answer"
    elif "capital letters" in ins:
        fmt = "caps"
    elif "json" in ins:
        fmt = "json"
    elif "yaml" in ins:
        fmt = "yaml"
    elif "bullet" in ins:
        fmt = "bullets"
    elif "with the word end" in ins:
        fmt = "end_marker"
    return Reading(
        target=target,
        listing=bool(re.match(r"(list|name)\b", low)),
        length=length,
        fmt=fmt,
        no_colors="not mention any color" in ins,
        okay="with the word okay" in ins,
        count="number of objects" in ins,
        no_image_word="not use the word image" in ins,
    )


# --- composing a response -------------------------------------------------------------------------------


def _sentence(s: str) -> str:
    s = s.strip()
    s = s[0].upper() + s[1:] if s else s
    return s if s.endswith((".", "!", "?")) else s + "."


def _content(f: Facts, r: Reading) -> tuple[str, list[str], str]:
    """(response text, its items for a bulleted list, the short answer for a FINAL ANSWER line)."""
    t, length = r.target, r.length
    if t == "colors" and not f.colors:
        t = "image"  # asked for the colours but told not to name any: describe without them
    final = None
    if t == "text" and f.words:
        items, short = list(f.words), join_words(list(f.words))
        quoted = join_words([f'"{w}"' for w in f.words])
        medium, extra = f"The text reads {quoted}.", f.details
    elif t == "text":
        items, short, medium, extra = ["no text"], "no text", "There is no text in the image.", [f.summary]
    elif t == "colors":
        items, short = list(f.colors), join_words(f.colors)
        medium, extra = f"The colors are {short}.", [f.summary]
    elif t == "objects":
        items, short = list(f.items), join_words(f.items)
        medium, extra = f"The image contains {short}.", [f.layout]
    elif t == "layout":
        items, short, medium, extra, final = [f.layout], f.caption, f.layout, f.details, f.caption
    elif t == "detail":
        items, short, medium, extra, final = [f.highlight], f.highlight, f.highlight, [f.summary], f.caption
    else:
        items, short, medium, extra = list(f.items), f.caption, f.summary, f.details
        if t == "caption":
            length = "short"
    extra = [e for e in extra if e != medium][:2]  # long answers: at most two sentences more
    if r.listing:
        listed = ", ".join(items)
        body = {"short": listed, "medium": _sentence(listed), "long": " ".join([_sentence(listed), *extra[:1]])}[length]
    else:
        body = {"short": short, "medium": medium, "long": " ".join([medium, *extra])}[length]
    return body[0].upper() + body[1:], items, final or short


def _replace_image_word(text: str) -> str:
    return re.sub(r"\b(image|Image|IMAGE)\b", lambda m: {"image": "picture", "Image": "Picture", "IMAGE": "PICTURE"}[m.group(1)], text)


def respond(facts_of: Callable[[bool], Facts], request: str) -> str:
    """The teacher's intended answer to a generic request about an image. ``facts_of(colors)`` returns the
    scene's facts with or without colour words."""
    r = read_request(request)
    f = facts_of(not r.no_colors)
    body, items, short = _content(f, r)
    if r.count:
        body = f"{_sentence(body)} There {'is' if f.count == 1 else 'are'} {plural(f.count, f.noun[:-1], f.noun)}."
        body = body.replace("lines of texts", "lines of text").replace("one lines of text", "one line of text")
    if r.okay:
        body = f"Okay. {body}"
    if r.fmt == "bullets":
        body = "\n".join(f"- {item}" for item in items)
        if r.okay:
            body = "Okay.\n" + body
    if r.no_image_word:
        body, short = _replace_image_word(body), _replace_image_word(short)
    if r.fmt == "final_answer":
        body = f"{body}\nFINAL ANSWER: {short}"
    elif r.fmt == "caps":
        body = body.upper()
    elif r.fmt == "json":
        body = json.dumps({"answer": body})
    elif r.fmt == "yaml":
        body = yaml.safe_dump({"answer": body}, default_flow_style=False, width=10_000).strip()
    elif r.fmt == "end_marker":
        body = f"{body} END"
    return body


# --- drawing a request ----------------------------------------------------------------------------------


FORMAT_P = 0.45  # the prompt sampler's p_format (params.yaml: sample.sampler.p_format)


def sample_request(rng: random.Random, pool: PromptPool, p_block: float = 0.72, p_format: float = FORMAT_P) -> str:
    """A user request in the style of the pipeline's prompt sampler (SPEC section 5): an inner prompt, and
    with probability ``p_block`` an instruction block (base; length p=0.75; format ``p_format``; probe p=0.40).
    The block's placement and separators vary, so the teacher does not depend on one layout."""
    prompt = rng.choice(pool.prompts)
    if rng.random() >= p_block:
        return prompt
    block = [pool.base_instruction]
    if rng.random() < 0.75:
        names = list(pool.lengths)
        block.append(pool.lengths[rng.choices(names, weights=[pool.lengths[k][0] for k in names])[0]][1])
    if rng.random() < p_format:
        block.append(pool.formats[rng.choice(sorted(pool.formats))])
    if rng.random() < 0.40:
        block.append(rng.choice(pool.probes))
    layout = rng.random()
    if layout < 0.4:  # the pipeline's sampler (pipeline/teacher/prompts.py): the block first, then the prompt
        return " ".join(block) + "\n" + prompt
    if layout < 0.7:
        return prompt + "\n" + " ".join(block)
    if layout < 0.85:
        return prompt + " " + " ".join(block)
    return "\n".join(block) + "\n" + prompt
