"""Stage parameters: unknown or ill-typed keys are errors that name them; the shipped params.yaml loads."""

from dataclasses import dataclass, field

import pytest

from pipeline import params
from pipeline.params import ParamsError


@dataclass
class Inner:
    rate: float = 0.5


@dataclass
class Section:
    steps: int = 10
    name: str = "x"
    lr: float | None = None
    flags: list[int] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)


def test_valid_section_with_int_for_float():
    s = params.from_dict(Section, {"steps": 3, "lr": 1, "flags": [1, 2], "inner": {"rate": 1}})
    assert s.steps == 3 and s.lr == 1.0 and isinstance(s.lr, float) and s.inner.rate == 1.0


@pytest.mark.parametrize("data, message", [
    ({"stepz": 3}, "unknown parameter.*sec.stepz"),
    ({"steps": "3"}, "'sec.steps'.*integer"),
    ({"steps": 2.5}, "'sec.steps'.*integer"),
    ({"steps": True}, "'sec.steps'.*integer"),
    ({"lr": "fast"}, "'sec.lr'"),
    ({"flags": [1, "a"]}, r"'sec.flags\[1\]'"),
    ({"inner": {"rte": 1}}, "sec.inner.rte"),
])
def test_bad_values_name_the_key(data, message):
    with pytest.raises(ParamsError, match=message):
        params.from_dict(Section, data, prefix="sec")


def test_missing_file_and_bad_top_level(tmp_path):
    with pytest.raises(ParamsError, match="not found"):
        params.read(tmp_path / "missing.yaml")
    for text, message in [("- a\n- b\n", "mapping of sections"), ("bogus: 1\n", "unknown top-level key.*bogus"),
                          (": [\n", "not valid YAML")]:
        (tmp_path / "p.yaml").write_text(text)
        with pytest.raises(ParamsError, match=message):
            params.read(tmp_path / "p.yaml")


def test_exponent_floats_as_dvc_writes_them(tmp_path):
    # `dvc exp run -S sec.lr=3e-5` writes `lr: 3e-05`, a string to YAML 1.1 and a float to DVC (YAML 1.2)
    (tmp_path / "p.yaml").write_text("sec:\n  lr: 3e-05\n  inner: {rate: 1E+2}\n  name: 3e-05x\n")
    s = params.from_dict(Section, params.load_yaml(tmp_path / "p.yaml")["sec"], "sec")
    assert s.lr == 3e-5 and s.inner.rate == 100.0 and s.name == "3e-05x"
    (tmp_path / "p.yaml").write_text("sec:\n  lr: '3e-05'\n")  # quoted: still a string, still an error
    with pytest.raises(ParamsError, match="'sec.lr'"):
        params.from_dict(Section, params.load_yaml(tmp_path / "p.yaml")["sec"], "sec")


def _shipped():
    return params.load_yaml(params.Path(__file__).resolve().parent.parent / "params.yaml")


def test_every_top_level_key_has_a_schema_and_the_shipped_file_validates():
    doc = _shipped()
    assert set(doc) == set(params.sections())
    params.validate(doc)


def _schemas(tp, key):
    import dataclasses
    import typing

    hints = typing.get_type_hints(tp)
    for f in dataclasses.fields(tp):
        yield f"{key}.{f.name}", f
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _schemas(hints[f.name], f"{key}.{f.name}")


@pytest.mark.parametrize("section", sorted(params.sections()))
def test_params_yaml_is_the_only_home_of_defaults(section):
    """No field of a section's schema (nested ones too) has a default of its own: every value comes from the file."""
    import dataclasses

    tp = params.sections()[section]
    if not dataclasses.is_dataclass(tp):
        return                                   # a plain value (formats, heldout_prompts)
    with_default = [key for key, f in _schemas(tp, section)
                    if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
    assert with_default == []
    doc = _shipped()
    missing = dict(doc[section])
    missing.pop(next(iter(missing)))
    with pytest.raises(ParamsError, match="missing parameter"):
        params.from_dict(tp, missing, section)


def test_defaults_come_from_the_project_file(tmp_path):
    from pipeline.qat.train import QATParams
    from pipeline.toy.model import ModelSize

    shipped = _shipped()
    p = params.defaults(QATParams, "qat", steps=3)
    assert p.steps == 3 and p.lr_scale == shipped["qat"]["lr_scale"]
    assert params.defaults(ModelSize, "toy_teacher.model").text_layers == shipped["toy_teacher"]["model"]["text_layers"]
    with pytest.raises(ParamsError, match="'qat.steps'"):
        params.defaults(QATParams, "qat", steps=0)
    with pytest.raises(ParamsError, match="no section 'qat.nope'"):
        params.defaults(QATParams, "qat.nope")
    with pytest.raises(ParamsError, match="not found"):
        params.defaults(QATParams, "qat", path=tmp_path / "missing.yaml")


@pytest.mark.parametrize("key, value, message", [
    ("qat.lr", float("nan"), "not a finite number"), ("qat.lr", float("inf"), "not a finite number"),
    ("qat.lr", -1e-4, "must be > 0"), ("generate.temperature", float("inf"), "not a finite number"),
    ("generate.temperature", -0.1, "must be >= 0"), ("eval.n", -1, "must be > 0"), ("eval.n", 0, "must be > 0"),
    ("eval.kl_batch_size", 0, "must be > 0"), ("fit.threads", -1, "must be >= 0"),
    ("sample.sampler.p_chat", 1.5, "p_chat"), ("heldout_prompts", 2.7, "heldout_prompts"),
    ("heldout_prompts", -1, "heldout_prompts"), ("formats", [], "formats"), ("formats", ["s3d9"], "s3d9"),
    ("formats", ["s3d8", "s3d8"], "twice"), ("qat.betas", [0.9, 1.5], "must be <= 1"),
    ("eval", 3, "expected a mapping"), ("qat.steps", 0, "must be > 0"),
])
def test_ranges_and_top_level_keys_are_checked_before_any_work(key, value, message):
    doc = _shipped()
    *path, last = key.split(".")
    node = doc
    for part in path:
        node = node[part]
    node[last] = value
    with pytest.raises(ParamsError, match=message):
        params.validate(doc)


def test_apply_preset_keeps_comments_and_layout(tmp_path):
    shipped = params.Path(__file__).resolve().parent.parent
    target = tmp_path / "params.yaml"
    target.write_text((shipped / "params.yaml").read_text())
    params.apply_preset(shipped / "configs/ci.yaml", target)
    before, after = (shipped / "params.yaml").read_text().splitlines(), target.read_text().splitlines()
    comments = [line.partition("#")[2] for line in before if "#" in line]
    assert comments == [line.partition("#")[2] for line in after if "#" in line]          # every comment kept
    assert sum(a == b for a, b in zip(before, after)) > 0.8 * len(before)                # the layout too
    assert params.read(target)["qat"].steps == params.load_yaml(shipped / "configs/ci.yaml")["qat"]["steps"]
    (tmp_path / "bad.yaml").write_text("qat: {stepz: 1}\n")
    with pytest.raises(ParamsError, match="qat.stepz"):
        params.apply_preset(tmp_path / "bad.yaml", target)


@pytest.mark.parametrize("preset", sorted(p.name for p in (params.Path(__file__).resolve().parent.parent / "configs").glob("*.yaml")))
def test_every_shipped_preset_applies(tmp_path, preset):
    """Each ``configs/*.yaml`` applies on the shipped params.yaml as the README says (the 11B preset once set
    ``threads: null``, which no section accepts), and the 8-GPU launch preset applies on top of it."""
    root = params.Path(__file__).resolve().parent.parent
    target = tmp_path / "params.yaml"
    target.write_text((root / "params.yaml").read_text())
    params.apply_preset(root / "configs" / preset, target)
    if preset == "llama-3.2-11b-vision.yaml":
        params.apply_preset(root / "configs/launch/gpu8-fsdp2-11b.yaml", target)
        assert params.read(target)["launch"].num_processes == 8
