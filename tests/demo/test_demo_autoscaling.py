"""The demo's opt-in autoscaling (workers/demo.py): the deployment section it asks for and what it
reports of the scale steps. The run itself is `rollouts demo --replicas 1 --max-replicas 2` on
the real stack (docs/operations.md, Autoscaling)."""

from __future__ import annotations

from workers.demo import DemoConfig, ScaleLog, _autoscaling


def test_a_fixed_size_unless_max_is_above_min():
    assert _autoscaling(DemoConfig()) == {"min": 2, "max": 2}
    assert _autoscaling(DemoConfig(replicas=2, max_replicas=2)) == {"min": 2, "max": 2}
    assert _autoscaling(DemoConfig(replicas=1, max_replicas=2)) == {
        "min": 1,
        "max": 2,
        "targetInFlight": 2,
        "scaleOutAfterSeconds": 10,
        "scaleInAfterSeconds": 20,
    }


def test_each_change_of_the_serving_replicas_is_told_once():
    said: list[str] = []
    log = ScaleLog(DemoConfig(replicas=1, max_replicas=2), said.append)
    dep = lambda n: {"status": {"readyReplicas": n}}  # noqa: E731
    log.seen(dep(1), 1, 5.0)
    log.seen(dep(2), 4, 41.0)
    log.seen(dep(2), 5, 50.0)
    assert said == ["autoscaling: 1 → 2 serving replicas after step 4 (41 s into the loop)"]
    answers = iter([dep(2), dep(1)])
    log.until_scaled_in(lambda: next(answers))
    assert said[-1].startswith("autoscaling: 2 → 1 serving replicas ") and "after the load stopped" in said[-1]
    assert log.summary().startswith("min 1, max 2: 1 → 2 serving replicas after step 4")
