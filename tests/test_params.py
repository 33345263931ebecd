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


def test_missing_section_and_file(tmp_path):
    (tmp_path / "p.yaml").write_text("other: {}\n")
    with pytest.raises(ParamsError, match="no section 'sec'"):
        params.load(Section, "sec", tmp_path / "p.yaml")
    with pytest.raises(ParamsError, match="not found"):
        params.load(Section, "sec", tmp_path / "missing.yaml")


def test_exponent_floats_as_dvc_writes_them(tmp_path):
    # `dvc exp run -S sec.lr=3e-5` writes `lr: 3e-05`, a string to YAML 1.1 and a float to DVC (YAML 1.2)
    (tmp_path / "p.yaml").write_text("sec:\n  lr: 3e-05\n  inner: {rate: 1E+2}\n  name: 3e-05x\n")
    s = params.load(Section, "sec", tmp_path / "p.yaml")
    assert s.lr == 3e-5 and s.inner.rate == 100.0 and s.name == "3e-05x"
    (tmp_path / "p.yaml").write_text("sec:\n  lr: '3e-05'\n")  # quoted: still a string, still an error
    with pytest.raises(ParamsError, match="'sec.lr'"):
        params.load(Section, "sec", tmp_path / "p.yaml")


def test_shipped_params_yaml_loads_every_stage_section():
    from stages.eval import EvalParams
    from stages.fit_centroids import FitParams
    from stages.pack_safetensors import PackParams
    from stages.sample_prompts import SampleParams
    from stages.teacher_generate import GenerateParams
    from pipeline.qat.train import QATParams
    from pipeline.teacher import TeacherParams

    for cls, section in [(TeacherParams, "teacher"), (FitParams, "fit"), (SampleParams, "sample"),
                         (GenerateParams, "generate"), (QATParams, "qat"), (PackParams, "pack"), (EvalParams, "eval")]:
        params.load(cls, section)
