"""The toy tasks: deterministic, held-out scenes never trained on, references that match the pictures."""

import json
import random

import pytest
import yaml

from pipeline.eval import metrics
from pipeline.eval.tasks import family_of, score
from pipeline.toy.tasks import load_toy
from pipeline.teacher.prompts import load_pool
from pipeline.toy import charts, describe, diagrams, documents, draw, shapes, tasks


@pytest.mark.parametrize("task", [*tasks.TOY_TASKS, tasks.DESCRIBE])
def test_items_are_deterministic_and_prefix_stable(task):
    a = tasks.items(task, 6, seed=3)
    b = tasks.items(task, 3, seed=3)
    for x, y in zip(a, b):
        assert (x.id, x.prompt, x.response, x.references) == (y.id, y.prompt, y.response, y.references)
        assert x.image.tobytes() == y.image.tobytes()
    c = tasks.items(task, 6, seed=4)
    assert [x.prompt + x.response for x in a] != [x.prompt + x.response for x in c]


@pytest.mark.parametrize("task", [*tasks.TOY_TASKS, tasks.DESCRIBE])
def test_splits_hold_disjoint_scenes(task):
    test = {it.scene_key for it in tasks.items(task, 60, split="test")}
    train = {it.scene_key for it in tasks.items(task, 300, split="train")}
    assert test and train and not test & train
    assert all(tasks.split_of(k) == "test" for k in test)


def test_heldout_share_of_scenes():
    rng = random.Random(0)
    keys = {shapes.sample(rng).key for _ in range(4000)}
    share = sum(tasks.split_of(k) == "test" for k in keys) / len(keys)
    assert 0.09 < share < 0.16  # one eighth


def test_images_are_64px_rgb():
    for task in tasks.TOY_TASKS:
        image = tasks.item(task, 0, 0).image
        assert image.size == (draw.IMAGE_SIZE, draw.IMAGE_SIZE) and image.mode == "RGB"


def test_unknown_task_and_split_are_errors():
    with pytest.raises(ValueError, match="unknown toy task"):
        tasks.items("toy-nope", 1)
    with pytest.raises(ValueError, match="unknown split"):
        tasks.items("toy-vqa", 1, split="val")


def _pixel(image, x, y):
    return image.getpixel((int(x), int(y)))


def test_vqa_answers_match_the_scene():
    rng = random.Random(1)
    kinds = set()
    for _ in range(300):
        scene = shapes.sample(rng)
        q, answer, refs = shapes.question(scene, rng)
        assert len(refs) == 10
        assert metrics.vqa_accuracy(answer, refs) == 1.0  # the canonical answer always scores 1
        by_shape = {t.shape: t.color for t in scene.things}
        colors = {t.color for t in scene.things}
        if q.startswith(("What color is the", "What is the color of the")):
            kinds.add("color")
            named = q.rstrip("?").split()[-1]
            assert answer == (by_shape[named] if named in by_shape else scene.things[0].color)
        elif q.startswith("What shape"):
            kinds.add("shape")
            assert len(scene.things) == 1 and answer == scene.things[0].shape
        elif q.startswith("How many"):
            kinds.add("count")
            assert answer == str(len(scene.things))
        elif q.endswith(" shape?"):
            kinds.add("has_color")
            assert answer == ("yes" if q.split()[-2] in colors else "no")
        else:
            kinds.add("has_shape")
            assert answer == ("yes" if q.rstrip("?").split()[-1] in by_shape else "no")
        # every shape is drawn in its colour at its cell centre
        image = shapes.render(scene)
        for t in scene.things:
            assert _pixel(image, 16 + 32 * (t.cell % 2), 16 + 32 * (t.cell // 2) + 2) == draw.COLORS[t.color]
    assert kinds == {"color", "shape", "count", "has_color", "has_shape"}


def test_chart_bars_have_their_values():
    rng = random.Random(2)
    for _ in range(50):
        scene = charts.sample(rng)
        image = charts.render(scene)
        for i, bar in enumerate(scene.bars):
            x = charts.COLUMN * i + charts.BAR_LEFT + charts.BAR_WIDTH / 2
            top = charts.BASE_Y - bar.value * charts.UNIT
            assert _pixel(image, x, top + 1) == draw.COLORS[bar.color]
            assert _pixel(image, x, top - 2) != draw.COLORS[bar.color]
        q, answer, refs = charts.question(scene, rng)
        top = max(scene.bars, key=lambda b: b.value)
        low = min(scene.bars, key=lambda b: b.value)
        by_color = {b.color: b.value for b in scene.bars}
        expected = {
            "Which bar is the tallest?": top.color, "Which color is the tallest bar?": top.color,
            "Which bar has the highest value?": top.color, "What is the highest value in the chart?": str(top.value),
            "What is the value of the tallest bar?": str(top.value), "Which bar is the shortest?": low.color,
            "Which color is the shortest bar?": low.color, "Which bar has the lowest value?": low.color,
            "What is the lowest value in the chart?": str(low.value), "What is the value of the shortest bar?": str(low.value),
        }
        if q in expected:
            assert answer == expected[q]
        else:
            assert answer == str(by_color[q.split()[-2]])


def test_document_questions():
    rng = random.Random(3)
    for _ in range(100):
        scene = documents.sample(rng)
        q, answer, refs = documents.question(scene, rng)
        if q.startswith(("What is the title", "What is written in the title", "What is the heading")):
            assert answer == scene.title
        elif "last" in q or "second" in q:
            assert answer == scene.lines[1] and answer in documents.LINE_WORDS[1]
        else:
            assert answer == scene.lines[0] and answer in documents.LINE_WORDS[0]
        assert metrics.anls(answer, refs) == 1.0


def test_diagram_questions_follow_the_arrows():
    rng = random.Random(4)
    for _ in range(100):
        scene = diagrams.sample(rng)
        q, answer, options = diagrams.question(scene, rng)
        assert options == list(draw.SHAPES) and answer in options
        flow = scene.flow
        assert flow == scene.shapes
        if "first" in q or "start" in q:
            assert answer == flow[0]
        elif "last" in q or "end" in q:
            assert answer == flow[-1]
        else:
            assert answer not in flow


@pytest.mark.parametrize("task", tasks.TOY_TASKS)
def test_intended_responses_score_one_and_prompts_match_the_benchmark(task):
    for ex, it in zip(load_toy(task, 40), tasks.items(task, 40)):
        _, s = score(family_of(task), ex, it.response)
        assert s == 1.0, (it.prompt, it.response, it.references)
    family = family_of(task)
    sample = tasks.item(task, 0, 0)
    suffix = {"vqa": "single word or phrase.", "chartqa": "'FINAL ANSWER: <answer>'.", "docvqa": "single word or phrase.",
              "ai2d": "from the given choices directly."}[family]
    assert sample.prompt.endswith(suffix)


def test_heldout_examples_are_image_prompt_response():
    image, prompt, response = tasks.heldout_examples("toy-chartqa", 2)[1]
    assert image.size == (64, 64) and "FINAL ANSWER" in prompt and response.startswith("FINAL ANSWER: ")


# --- generic requests ----------------------------------------------------------------------------------


def _facts(module, seed=0):
    scene = module.sample(random.Random(seed))
    return lambda colors: module.facts(scene, colors)


def test_every_pool_prompt_gets_an_answer_for_every_kind_of_image():
    pool = load_pool()
    assert len(pool.prompts) == 495
    for module in (shapes, charts, documents, diagrams):
        facts = _facts(module)
        for prompt in pool.prompts:
            response = describe.respond(facts, prompt)
            assert response and response[0].isupper() and "  " not in response, (prompt, response)


COLOR_WORDS = set(draw.COLORS) | {"black", "white"}


@pytest.mark.parametrize("module", [shapes, charts, documents, diagrams])
def test_instruction_styles_are_followed(module):
    f = _facts(module, 5)
    p = "Describe the image."
    assert describe.respond(f, p + "\nAnswer in capital letters.").isupper()
    assert json.loads(describe.respond(f, p + "\nAnswer in JSON with the key \"answer\".")).keys() == {"answer"}
    assert set(yaml.safe_load(describe.respond(f, p + "\nAnswer in YAML with the key answer."))) == {"answer"}
    bullets = describe.respond(f, p + "\nAnswer as a bulleted list.").split("\n")
    assert all(line.startswith("- ") for line in bullets)
    final = describe.respond(f, p + "\nEnd with a line 'FINAL ANSWER: <answer>'.")
    assert final.split("\n")[-1].startswith("FINAL ANSWER: ") and len(final.split("\n")) == 2
    assert describe.respond(f, p + "\nEnd your answer with the word END.").endswith(" END")
    assert describe.respond(f, p + "\nStart your answer with the word Okay.").startswith("Okay.")
    no_colors = describe.respond(f, "Describe the colors in the picture in detail.\nDo not mention any colors.")
    assert not COLOR_WORDS & set(no_colors.lower().replace(".", " ").replace(",", " ").split())
    assert "image" not in describe.respond(f, p + " Answer in detail. Do not use the word image.").lower()
    assert " are " in describe.respond(f, p + " Mention the number of objects.") or " is one" in describe.respond(
        f, p + " Mention the number of objects.")


def test_lengths_grow_from_short_to_long():
    f = _facts(shapes, 7)
    short = describe.respond(f, "Describe the image. Answer in a few words.")
    medium = describe.respond(f, "Describe the image. Answer in one sentence.")
    long = describe.respond(f, "Describe the image. Answer in detail.")
    assert len(short) < len(medium) < len(long)
    assert not short.endswith(".") and medium.count(".") == 1 and long.count(".") >= 3


def test_text_requests_read_the_document():
    scene = documents.sample(random.Random(8))
    response = describe.respond(lambda c: documents.facts(scene, c), "Describe any text in the image.")
    assert all(w in response for w in (scene.title, *scene.lines))
    shapes_scene = shapes.sample(random.Random(8))
    assert "no text" in describe.respond(lambda c: shapes.facts(shapes_scene, c), "Describe any text in the image.").lower()


def test_sampled_requests_follow_the_pool_shape():
    pool = load_pool()
    rng = random.Random(0)
    requests = [describe.sample_request(rng, pool) for _ in range(400)]
    with_block = [r for r in requests if pool.base_instruction in r]
    assert 0.6 < len(with_block) / len(requests) < 0.85
    assert all(any(p in r for p in pool.prompts) for r in requests)


def test_missing_pool_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_pool(tmp_path / "nope.yaml")


def test_format_share_of_generic_training_requests():
    """``toy_teacher.train.describe_format_p`` raises the share of format instructions (capitals, JSON ...) in
    generic requests."""
    pool = load_pool()

    def share(p_format):
        drawn = [tasks.item(tasks.DESCRIBE, 0, i, "train", p_format) for i in range(300)]
        return sum(any(f in it.prompt for f in pool.formats.values()) for it in drawn) / len(drawn)

    assert share(0.0) == 0.0
    assert 0.2 < share(describe.FORMAT_P) < 0.45 < 0.6 < share(1.0) < 0.8  # a block is drawn 72% of the time
