"""A point's record as it ends (experiments/sweep/point.py): appended to the results, and a failed point named once
however often its job failed."""

import json

from experiments.sweep import spec as specs
from experiments.sweep.base_models import BaseModels
from experiments.sweep.point import PointLife


def test_a_point_failing_twice_is_one_failed_point(tmp_path):
    """On a cluster a failed job is collected, its point submitted again, and that job may fail too: two records,
    one failed point (the summary would otherwise count it twice and report a negative number of ok points)."""
    spec, (point,) = specs.points_of(specs.parse_spec({"sweep": {"name": "s"}, "axes": {"seeds": [1]}}))
    life = PointLife(spec, tmp_path, ["python", "-m", "memtrain"], BaseModels(spec.pretrain, [], None, log=print),
                     resume=True, log=lambda *a: None)
    record = {"point": point.id, "run_dir": str(tmp_path / point.id), "status": "failed", "error": "job died",
              "seconds": 1.0}
    for error in ("job 7 died", "job 8 died"):
        life.finish(dict(record, error=error))
    assert life.failed == [point.id]
    assert [json.loads(x)["error"] for x in (tmp_path / "results.jsonl").read_text().splitlines()] == [
        "job 7 died", "job 8 died"]  # both kept: the results file is the sweep's history
