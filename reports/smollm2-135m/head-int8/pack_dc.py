"""Pack stage direct-cast's s3d8 output alone (no QAT model yet) into OUT/s3d8/direct-cast, as pack-safetensors does."""
import sys
from dataclasses import asdict

import pipeline.cpu_numerics  # noqa: F401
from pipeline import formats, params
from pipeline.cast.direct import DirectCast
from pipeline.cast.fit import check_states
from pipeline.cast.ptq import PackParams
from pipeline.files.atomic import atomic_dir
from pipeline.formats.precision import Precision
from pipeline.hf.write import write_model_dir
from pipeline.models import dtype_of, load_config
from pipeline.pack_run import checked
from pipeline.packed.checkpoint import CheckpointReader
from pipeline.stage import versions
from pipeline.teacher.source import TeacherParams, local_dir

out_root = sys.argv[1]
fmt = formats.get("s3d8")
p = params.load(PackParams, "pack", "params.yaml")
teacher = params.load(TeacherParams, "teacher", "params.yaml")
states = check_states(fmt, fmt.load_states("data/centroids/s3d8.safetensors"), "centroids")
plan = Precision(fmt, p.precision)
states = {n: st for n, st in states.items() if plan.format_of(n) is not None}
other = {n: f for n in states if (f := plan.format_of(n)) is not fmt}
cast = DirectCast("models/direct-cast/s3d8", fmt, p.algorithm)
teacher_dir = local_dir(teacher.dir)
reader = CheckpointReader(teacher_dir)
with atomic_dir(f"{out_root}/s3d8") as out:
    s = write_model_dir(out / "direct-cast", reader, fmt, states,
                        encode=checked(lambda name, w, state: cast.packed(name, w.shape), reader),
                        teacher_dir=teacher_dir, method="direct-cast", base_model=teacher.source,
                        teacher_name=teacher.name, dtype=dtype_of(p.dtype),
                        metadata={"config": load_config(teacher.dir).to_dict(), "method": "direct-cast",
                                  "source_model": teacher.source, "teacher": teacher.name,
                                  "pack_params": asdict(p), **versions(), "rotate": teacher.rotate,
                                  "rotate_seed": teacher.rotate_seed},
                        progress=lambda name: None, other=other)
print({k: v for k, v in s.items() if k != "files"})
