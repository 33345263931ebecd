"""The toy world's four tasks and its generic descriptions: deterministic items for training and held-out
evaluation.

Every scene has a key (its content, without jitter); a fixed eighth of all keys, chosen by hash, is held out:
training never draws those scenes, evaluation draws only those. Items are a pure function of
(task, split, seed, index), so a slice of n items is the first n of any longer slice.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from types import ModuleType

from PIL import Image

from pipeline.teacher import images
from pipeline.eval import tasks as eval_tasks
from pipeline.eval.task_prompts import option_letter, prompt_for
from pipeline.teacher.prompts import PromptPool, load_pool
from pipeline.toy import charts, describe, diagrams, documents, shapes

TASK_MODULES: dict[str, ModuleType] = {
    "toy-vqa": shapes,
    "toy-chartqa": charts,
    "toy-docvqa": documents,
    "toy-ai2d": diagrams,
}
TASK_FAMILY = {"toy-vqa": "vqa", "toy-chartqa": "chartqa", "toy-docvqa": "docvqa", "toy-ai2d": "ai2d"}
TOY_TASKS = tuple(TASK_MODULES)
DESCRIBE = "toy-describe"  # generic requests from the prompt pool about any toy image
HELDOUT_EVERY = 8
SPLITS = ("train", "test")


@dataclass(frozen=True)
class ToyItem:
    """One image with a request and the response the teacher is trained to give."""

    task: str  # a toy task, or "toy-describe"
    id: str
    image: Image.Image
    question: str  # the bare question (the request itself for descriptions)
    prompt: str  # the user text: the benchmark prompt around the question, or the request
    response: str  # the intended answer, as the teacher should write it
    references: tuple[str, ...]  # what the metric compares with (the response for descriptions)
    options: tuple[str, ...] | None = None
    answer_index: int | None = None
    scene_key: str = ""


def split_of(key: str) -> str:
    digest = hashlib.sha256(key.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "little") % HELDOUT_EVERY == 0 else "train"


def _check(task: str, split: str) -> None:
    if task not in TASK_MODULES and task != DESCRIBE:
        raise ValueError(f"unknown toy task {task!r}; known: {[*TOY_TASKS, DESCRIBE]}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {SPLITS}")


def sample_scene(module: ModuleType, rng: random.Random, split: str):
    while True:
        scene = module.sample(rng)
        if split_of(scene.key) == split:
            return scene


def task_item(task: str, rng: random.Random, split: str, item_id: str) -> ToyItem:
    """A question of one of the four toy tasks, with the benchmark prompt and metric references."""
    module = TASK_MODULES[task]
    scene = sample_scene(module, rng, split)
    family = TASK_FAMILY[task]
    question, answer, extra = module.question(scene, rng)
    if family == "ai2d":
        options = tuple(extra)
        index = options.index(answer)
        return ToyItem(task, item_id, module.render(scene), question, prompt_for(family, question, options),
                       option_letter(index), (option_letter(index),), options, index, scene.key)
    response = f"FINAL ANSWER: {answer}" if family == "chartqa" else answer
    return ToyItem(task, item_id, module.render(scene), question, prompt_for(family, question), response,
                   tuple(extra), None, None, scene.key)


def describe_item(rng: random.Random, split: str, item_id: str, pool: PromptPool | None = None,
                  p_format: float = describe.FORMAT_P) -> ToyItem:
    """A generic request from the prompt pool about an image of any of the four kinds; ``p_format``: the
    probability of a format instruction in its instruction block."""
    pool = pool or load_pool()
    module = rng.choice(list(TASK_MODULES.values()))
    scene = sample_scene(module, rng, split)
    request = describe.sample_request(rng, pool, p_format=p_format)
    response = describe.respond(lambda colors: module.facts(scene, colors), request)
    return ToyItem(DESCRIBE, item_id, module.render(scene), request, request, response, (response,), None, None, scene.key)


def caption_item(rng: random.Random, split: str, request: str) -> ToyItem:
    """A fixed request (e.g. "Describe the image in detail.") about an image of any of the four kinds."""
    module = rng.choice(list(TASK_MODULES.values()))
    scene = sample_scene(module, rng, split)
    response = describe.respond(lambda colors: module.facts(scene, colors), request)
    return ToyItem(DESCRIBE, f"caption/{scene.key}", module.render(scene), request, request, response, (response,),
                   None, None, scene.key)


def item(task: str, seed: int, index: int, split: str = "test", p_format: float = describe.FORMAT_P) -> ToyItem:
    """Item ``index`` of ``task``'s ``split`` for ``seed``: independent of how many others are drawn
    (``p_format``: see ``describe_item``; generic requests only)."""
    _check(task, split)
    rng = random.Random(f"{task}/{split}/{seed}/{index}")
    item_id = f"{task}/{split}/{seed}/{index}"
    if task == DESCRIBE:
        return describe_item(rng, split, item_id, p_format=p_format)
    return task_item(task, rng, split, item_id)


def items(task: str, n: int, seed: int = 0, split: str = "test") -> list[ToyItem]:
    """``n`` items of a toy task (or "toy-describe"); held-out ("test") by default."""
    _check(task, split)
    return [item(task, seed, i, split) for i in range(n)]


def heldout_examples(task: str, n: int, seed: int = 0) -> list[tuple[Image.Image, str, str]]:
    """(image, user prompt, reference response) of held-out items: the teacher's intended responses, for
    measuring a student's KL to the teacher or its loss on responses it never trained on."""
    return [(it.image, it.prompt, it.response) for it in items(task, n, seed, "test")]


def text_corpus(n_per_task: int, seed: int = 0) -> list[str]:
    """Text the tokenizer is trained on: prompts and responses of training items of every task, generic
    requests and responses (also in capitals), the whole prompt pool and the chat template's words."""
    pool = load_pool()
    lines: list[str] = []
    for task in (*TOY_TASKS, DESCRIBE):
        n = n_per_task * (3 if task == DESCRIBE else 1)
        for i in range(n):
            it = item(task, seed, i, "train")
            lines += [it.prompt, it.response]
            if task == DESCRIBE:
                lines.append(it.response.upper())
    lines += list(pool.prompts) + [pool.base_instruction] + [t for _, t in pool.lengths.values()]
    lines += list(pool.formats.values()) + list(pool.probes)
    lines += ["user", "assistant", "system", "Cutting Knowledge Date: December 2023", "Today Date: 26 Jul 2024"]
    return lines


def load_toy(name: str, n: int = eval_tasks.DEFAULT_N, seed: int = 0, source: str | None = None) -> list[eval_tasks.EvalExample]:
    """``n`` held-out items of a toy task as evaluation examples (generated, so no shuffle is needed: items
    are i.i.d.)."""
    if source is not None:
        raise ValueError(f"{name}: toy tasks are generated, they take no source")
    return [eval_tasks.EvalExample(name, it.id, it.image, it.question, it.prompt, it.references, it.options,
                                   it.answer_index)
            for it in items(name, n, seed, "test")]


def training_image(seed: int, index: int) -> Image.Image:
    """A toy-world image of any of the four kinds, from the training split (never a held-out scene)."""
    rng = random.Random(f"image-pool/{seed}/{index}")
    module = rng.choice(list(TASK_MODULES.values()))
    return module.render(sample_scene(module, rng, "train"))


for _task in TOY_TASKS:   # the evaluation knows the toy tasks only through its registry
    eval_tasks.register(_task, TASK_FAMILY[_task], lambda n, seed, source, _task=_task: load_toy(_task, n, seed, source))
images.register("toy", training_image)   # the `toy` image pool of sample-prompts
