"""utils/profiling.py's phase-call records and split_calls: a phase's driver time split into the ranks' work, Ray's
dispatch and the results' return, on worked examples."""

import random
import time

import pytest

from rltrain.utils import profiling
from rltrain.utils.profiling import phase, split_calls, take_calls


def test_two_ranks_worked_example():
    # submit at 10.00; rank 0 enters 10.01, leaves 10.50; rank 1 enters 10.03, leaves 10.52; results in hand 10.60
    driver = [("compute_old_logprobs", 10.00, 10.60)]
    ranks = [[("compute_old_logprobs", "old_log_prob", 10.01, 10.50)],
             [("compute_old_logprobs", "old_log_prob", 10.03, 10.52)]]
    out = split_calls(driver, ranks)
    assert out == pytest.approx({"timing_s/worker/old_log_prob": 0.49, "timing_s/dispatch/old_log_prob": 0.03,
                                 "timing_s/return/old_log_prob": 0.08})


def test_the_drivers_slicing_before_the_submit_is_its_own_part():
    # slicing began 9.93 (0.01 s of the driver thread's CPU), submit 10.00; one rank 10.02-10.40; results 10.45. A
    # call without the slicing (None, or the three-field record) has no slice part
    ranks = [[("compute_ref_logprobs", "ref", 10.02, 10.40)]]
    out = split_calls([("compute_ref_logprobs", 10.00, 10.45, (9.93, 0.01))], ranks)
    assert out == pytest.approx({"timing_s/slice/ref": 0.07, "timing_s/slice_cpu/ref": 0.01,
                                 "timing_s/worker/ref": 0.38, "timing_s/dispatch/ref": 0.02,
                                 "timing_s/return/ref": 0.05})
    for record in (("compute_ref_logprobs", 10.00, 10.45, None), ("compute_ref_logprobs", 10.00, 10.45)):
        assert not any("slice" in k for k in split_calls([record], ranks))


def test_calls_of_one_phase_sum_and_unmatched_ones_add_nothing():
    rng = random.Random()
    t0 = rng.uniform(1e3, 1e6)
    driver = [("update_actor", t0, t0 + 1.0), ("device_memory", t0 + 1.1, t0 + 1.2),  # not a phase: no record
              ("update_actor", t0 + 2.0, t0 + 2.5)]
    ranks = [[("generate", "generate", t0 - 5.0, t0 - 4.0),  # an asynchronous submit the driver did not time
              ("update_actor", "update_actor", t0 + 0.1, t0 + 0.9),
              ("update_actor", "update_actor", t0 + 2.1, t0 + 2.3)]]
    out = split_calls(driver, ranks)
    assert out == pytest.approx({"timing_s/worker/update_actor": 0.8 + 0.2, "timing_s/dispatch/update_actor": 0.2,
                                 "timing_s/return/update_actor": 0.1 + 0.2})


def test_a_rank_missing_the_call_or_a_record_outside_it_drops_the_call():
    driver = [("compute_ref_logprobs", 5.0, 6.0)]
    assert split_calls(driver, [[("compute_ref_logprobs", "ref", 5.1, 5.9)], []]) == {}
    # a record that started before the submit belongs to another call
    assert split_calls(driver, [[("compute_ref_logprobs", "ref", 4.0, 5.5)]]) == {}
    assert split_calls([], [[("compute_ref_logprobs", "ref", 5.1, 5.9)]]) == {}


def test_phase_notes_each_call_even_a_failing_one():
    take_calls()

    class W:
        @phase("old_log_prob")
        def compute_old_logprobs(self, x):
            time.sleep(0.01)
            if x < 0:
                raise ValueError("bad")
            return x

    before = time.time()
    assert W().compute_old_logprobs(3) == 3
    with pytest.raises(ValueError):
        W().compute_old_logprobs(-1)
    calls = take_calls()
    assert [(c[0], c[1]) for c in calls] == [("compute_old_logprobs", "old_log_prob")] * 2
    assert all(before <= start < end and end - start >= 0.009 for _, _, start, end in calls)
    assert take_calls() == []


def test_records_are_bounded():
    take_calls()

    @phase("generate")
    def generate():
        return None

    for _ in range(profiling._CALLS.maxlen + 10):
        generate()
    assert len(take_calls()) == profiling._CALLS.maxlen
