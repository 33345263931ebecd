"""Ranks that wait for one another (``pipeline.launch.ranks``) on CPU processes (gloo) under torchrun, with a collective
timeout of 2 s and one rank's work made longer than it: the waits of eval, teacher-generate and qat-train end,
where the collectives they replaced time out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.stage_helpers import _env, build_tiny_teacher, run_stage, workdir

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = {"timeout_s": 2}

# eval's and teacher-generate's hand-over: rank 1 works 5 s, longer than the 2 s every collective allows
_COLLECT = """
import json, sys, time
import torch.distributed as dist
from pipeline.launch import ranks
from pipeline.launch.processes import settings
ranks.init_process_group(settings())
rank = dist.get_rank()
if rank == 1:
    time.sleep(5)
if sys.argv[1] == "collect":
    got = ranks.collect("test", [rank])
else:                                                # what eval did before: accelerate's gather_object
    from accelerate import PartialState
    from accelerate.utils import gather_object
    PartialState(cpu=True)
    got = gather_object([rank])
if got is not None and rank == 0:
    open("gathered.json", "w").write(json.dumps(got))
"""

# qat-train's reads on rank 0 (the sharded teacher and the fp32 student): each made 3 s long
_QAT_LOAD = """
import json, time, torch
from pipeline.launch.processes import settings
from pipeline.qat import engines as E
load = E.load_model
def slow(*args, **kwargs):
    time.sleep(10)
    return load(*args, **kwargs)
E.load_model = slow
import sys
engine = E.FSDP2Engine(settings())
teacher = engine.teacher(sys.argv[1], torch.bfloat16)
student = engine.student(sys.argv[1], lambda model: None, settings())
ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    same = torch.equal(teacher(input_ids=ids).logits, load(sys.argv[1], torch.bfloat16)(input_ids=ids).logits)
open(f"rank-{engine.rank}.json", "w").write(json.dumps({"rank": engine.rank, "same": same}))
"""


def _torchrun(cwd: Path, script: str, *args: str, processes: int = 2, **launch) -> subprocess.CompletedProcess:
    doc = yaml.safe_load((REPO / "params.yaml").read_text())["launch"]
    env = {**_env(), "PIPELINE_LAUNCH": json.dumps({**doc, "num_processes": processes, **launch})}
    (cwd / "script.py").write_text(script)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                           "--nproc-per-node", str(processes), "script.py", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_collect_hands_over_without_a_collective_while_a_rank_works(tmp_path):
    proc = _torchrun(tmp_path, _COLLECT, "collect", processes=3, **TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "gathered.json").read_text()) == [[0], [1], [2]]
    (tmp_path / "gathered.json").unlink()
    before = _torchrun(tmp_path, _COLLECT, "gather", processes=3, **TIMEOUT)      # without the fix
    assert before.returncode != 0 and "timed out" in before.stderr.lower(), before.stderr[-3000:]


def test_qat_waits_for_rank_0_reading_as_long_as_its_bytes_take(tmp_path):
    """Rank 0 reads for 10 s; the others wait in a group whose timeout is the bytes at launch.min_disk_mb_s."""
    teacher = build_tiny_teacher(tmp_path / "teacher")
    fsdp = {"strategy": "fsdp2", "teacher": "shard", "timeout_s": 6}     # a cold rank 1 may reach the broadcast
                                                                         # after rank 0's read seconds later
    slow_disk = _torchrun(tmp_path, _QAT_LOAD, str(teacher), min_disk_mb_s=0.01, **fsdp)   # ~0.6 MB: a minute a read
    assert slow_disk.returncode == 0, slow_disk.stderr[-3000:]
    rows = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank-*.json"))]
    assert rows == [{"rank": 0, "same": True}, {"rank": 1, "same": True}]
    fast_disk = _torchrun(tmp_path, _QAT_LOAD, str(teacher), min_disk_mb_s=1e6, **fsdp)   # the 6 s alone
    assert fast_disk.returncode != 0 and "timed out" in fast_disk.stderr.lower(), fast_disk.stderr[-3000:]


def test_teacher_generate_resumes_with_fewer_pending_shards_than_ranks(tmp_path):
    """After a resume one shard is left for 2 ranks: rank 1 has none and must not wait in a collective while
    rank 0 generates it for longer than the timeout (generation slowed to 5 s a shard)."""
    cwd = workdir(tmp_path / "w", build_tiny_teacher(tmp_path / "teacher"))
    run_stage(cwd, "sample_prompts.py")
    run_stage(cwd, "teacher_generate.py")
    whole = {f.name: f.read_bytes() for f in (cwd / "data/teacher").glob("*.parquet")}
    assert len(whole) == 3
    os.remove(cwd / "checkpoints/teacher-generate/shard-00001.parquet")
    slow = ("import runpy, sys, time\nimport pipeline.teacher.generate_answers as g\nshard = g.generate_shard\n"
            "g.generate_shard = lambda *a, **k: (time.sleep(5), shard(*a, **k))[1]\n"
            f"sys.argv = ['{REPO}/stages/teacher_generate.py']\n"
            f"runpy.run_path('{REPO}/stages/teacher_generate.py', run_name='__main__')\n")
    proc = _torchrun(cwd, slow, **TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 of 3 shards already done" in proc.stdout + proc.stderr
    assert {f.name: f.read_bytes() for f in (cwd / "data/teacher").glob("*.parquet")} == whole


_REUSE = """
import resource, torch
from pipeline.launch.processes import keep_freed_memory
faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt  # noqa: E731

def next_step():
    torch.ones(1 << 24).sum()                        # 64 MB touched, then freed
    before = faults()
    torch.ones(3 << 22).sum()                        # the next step's 48 MB (a block as large would not fit: memalign
    return faults() - before                         # asks for its alignment on top of the size)

with keep_freed_memory() as kept:
    assert kept
    inside = next_step()
print(inside, next_step())
"""


def test_launched_stages_reuse_freed_memory_instead_of_faulting_it_in():
    """run_stage's keep_freed_memory: within it a freed 64 MB block serves the next 48 MB without a page fault; after
    it glibc maps such blocks on their own again (12,288 faults of 4 KB pages here; fewer where the kernel backs
    them with huge pages), so a process that goes on does not keep its peak."""
    out = subprocess.run([sys.executable, "-c", _REUSE], capture_output=True, text=True, check=True, env=_env()).stdout
    inside, after = map(int, out.split())
    assert inside < 100, out
    assert after > inside, out
