"""compat/ray.init_local_ray: Ray's own node start-up timeout (a fixed 30 s in ray/_private/node.py, which a loaded
2-core machine can miss) is retried, a bounded number of times; any other error is raised at once."""

import pytest

from rltrain.compat import ray as compat_ray

TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                    "failed to startup or the GCS has become overloaded.")


class FakeInit:
    def __init__(self, errors):
        self.errors, self.calls = list(errors), []

    def __call__(self, **kw):
        self.calls.append(kw)
        if self.errors:
            raise self.errors.pop(0)
        return "context"


@pytest.fixture
def shutdowns(monkeypatch):
    import ray

    count = []
    monkeypatch.setattr(ray, "shutdown", lambda: count.append(1))
    return count


def test_a_start_up_timeout_is_retried_then_the_cluster_starts(shutdowns, capsys):
    init = FakeInit([TIMEOUT, TIMEOUT])
    assert compat_ray.init_local_ray(init, num_cpus=2) == "context"
    assert init.calls == [{"address": "local", "num_cpus": 2}] * 3
    assert len(shutdowns) == 2  # the half-started node is shut down before each new try
    assert capsys.readouterr().err.count("starting it again") == 2


def test_the_last_timeout_and_any_other_error_are_raised(shutdowns):
    init = FakeInit([TIMEOUT] * compat_ray.RAY_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        compat_ray.init_local_ray(init)
    assert len(init.calls) == compat_ray.RAY_START_ATTEMPTS
    other = FakeInit([ValueError("bad num_cpus")])
    with pytest.raises(ValueError, match="bad num_cpus"):
        compat_ray.init_local_ray(other, num_cpus=-1)
    assert len(other.calls) == 1
