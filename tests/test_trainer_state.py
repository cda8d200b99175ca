"""The trainer's state rules (``trainers/state.py``) and its reports (``trainers/progress.py``):
pure, no servers, no sleeping."""

from __future__ import annotations

import pytest

from coordinator.assignment import Assignment, JobConfig
from services.clocks import ClockWait
from trainers.progress import LOSS_EMA_WEIGHT, PHASE_REPORT_STEPS, Progress
from trainers.state import Move, StateError, TrainerState, needs_pull


def assignment(partitions: tuple[int, ...] = (0, 1), generation: int = 1, state: str = "active",
               member: str = "m1", consistency: str = "ssp") -> Assignment:
    return Assignment(member_id=member, generation=generation, partitions=partitions, state=state,
                      config=JobConfig(consistency=consistency, staleness=2, codec="topk+fp16", optimizer="lazyadam",
                                       lr=0.005, topic="t", partitions=4))


def wait(required: int | None, min_applied: int | None, own_applied: int = 0, staleness: int = 0) -> ClockWait:
    return ClockWait(clock=10, required=required, min_applied=min_applied, staleness=staleness, waited_s=0.0,
                     own_applied=own_applied)


def joined(start: int = 5, a: Assignment | None = None) -> TrainerState:
    s = TrainerState()
    s.joined("m1", start, a or assignment())
    return s


# -- joining and following assignments -------------------------------------------------------------

def test_joining_starts_at_the_given_clock_with_nothing_followed_yet() -> None:
    s = joined(start=7)
    assert (s.clock, s.last_pushed, s.assignment) == (7, 6, None)
    assert s.follow() is Move.REASSIGN  # the first assignment restarts the consumer from committed offsets


def test_joining_refuses_a_clock_below_one() -> None:
    with pytest.raises(ValueError, match="start clock"):
        TrainerState().joined("m1", 0, assignment())


def test_same_partitions_under_a_new_generation_only_move_the_fencing_token() -> None:
    s = joined()
    s.assigned(s.wanted)  # type: ignore[arg-type]
    newer = assignment(generation=2)
    s.heard(newer)
    assert s.follow() is Move.TRAIN
    assert s.assignment is newer


def test_other_partitions_need_a_reassignment_and_training_resumes_after_it() -> None:
    s = joined()
    s.assigned(s.wanted)  # type: ignore[arg-type]
    moved = assignment(partitions=(2,), generation=2)
    s.heard(moved)
    assert s.follow() is Move.REASSIGN
    assert s.assignment is not moved  # nothing is followed before the consumer moved
    s.assigned(moved)
    assert s.follow() is Move.TRAIN


@pytest.mark.parametrize("a", [assignment(partitions=()), assignment(state="paused")])
def test_no_partitions_or_an_inactive_state_idles(a: Assignment) -> None:
    s = joined(a=a)
    s.assigned(a)
    assert s.follow() is Move.IDLE


def test_nothing_heard_yet_idles() -> None:
    assert TrainerState().follow() is Move.IDLE


def test_draining_means_leave_even_with_partitions_in_hand() -> None:
    s = joined()
    s.assigned(s.wanted)  # type: ignore[arg-type]
    s.heard(assignment(partitions=(), generation=2, state="draining"))
    assert s.follow() is Move.LEAVE


def test_a_lost_lease_keeps_the_current_assignment_until_a_new_one_is_heard() -> None:
    s = joined()
    a = s.wanted
    s.assigned(a)  # type: ignore[arg-type]
    s.lease_lost()
    assert s.wanted is None and s.follow() is Move.TRAIN
    s.joined("m2", 9, assignment(member="m2", generation=3))
    assert s.step_allowed() is False  # a batch polled across the re-registration is dropped
    assert s.follow() is Move.REASSIGN


# -- the clock and the push in flight -----------------------------------------------------------------

def test_a_push_takes_the_clock_and_the_next_step_moves_on() -> None:
    s = joined(start=5)
    assert s.pushing() == 5
    assert (s.clock, s.inflight) == (6, 5)
    with pytest.raises(StateError, match="still in flight"):
        s.pushing()
    s.push_settled(committed=True)
    assert (s.inflight, s.last_pushed) == (None, 5)


def test_a_refused_push_leaves_last_pushed_and_resync_resumes_after_it() -> None:
    s = joined(start=5)
    s.pushing()
    s.push_settled(committed=True)   # clock 5 committed
    s.pushing()
    s.push_settled(committed=False)  # clock 6 refused (fenced)
    s.clock = 9                      # steps 7 and 8 were computed but never pushed
    s.resync()
    assert (s.clock, s.last_pushed, s.last_wait) == (6, 5, None)


def test_resync_with_a_push_in_flight_is_a_bug() -> None:
    s = joined()
    s.pushing()
    with pytest.raises(StateError, match="settle"):
        s.resync()


def test_settling_without_a_push_in_flight_is_a_bug() -> None:
    with pytest.raises(StateError, match="no push in flight"):
        joined().push_settled(committed=True)


def test_a_push_before_joining_is_a_bug() -> None:
    with pytest.raises(StateError, match="before joining"):
        TrainerState().pushing()


def test_a_push_made_under_an_earlier_id_does_not_move_the_new_ids_clocks() -> None:
    s = joined(start=5)
    s.pushing()                              # clock 5 as m1
    s.joined("m2", 3, assignment(member="m2"))  # lease lost, registered anew while it was in flight
    s.push_settled(committed=True)
    assert s.last_pushed == 2
    s.pushing()
    s.push_unsettled()
    assert s.unsettled == 3


# -- outages -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("committed, last_pushed", [(True, 5), (False, 4)])
def test_an_unsettled_push_counts_only_when_was_committed_says_so(committed: bool, last_pushed: int) -> None:
    s = joined(start=5)
    s.pulled(wait(required=3, min_applied=4))
    s.pushing()
    s.push_unsettled()
    assert (s.unsettled, s.inflight) == (5, None)
    s.outage_settled(committed)
    assert (s.unsettled, s.last_pushed) == (None, last_pushed)
    assert s.covers is None  # the replica is not trusted after an outage: the next step pulls in full
    s.resync()
    assert s.clock == last_pushed + 1


def test_an_outage_with_nothing_unsettled_only_drops_the_replica() -> None:
    s = joined(start=5)
    s.pulled(wait(required=3, min_applied=4))
    s.outage_settled(None)
    assert (s.covers, s.last_pushed, s.last_wait) == (None, 4, None)


# -- pulls ----------------------------------------------------------------------------------------------

def test_a_pull_is_needed_until_the_replica_covers_the_bound() -> None:
    s = joined()
    assert s.needs_pull(wait(required=3, min_applied=3))  # never pulled
    s.pulled(wait(required=3, min_applied=4))
    assert s.covers == 4
    assert not s.needs_pull(wait(required=4, min_applied=4))
    assert s.needs_pull(wait(required=5, min_applied=5))


def test_asp_always_pulls_the_newest() -> None:
    assert needs_pull(100, wait(required=None, min_applied=3))


def test_a_pull_with_nobody_participating_covers_nothing_yet() -> None:
    s = joined()
    s.pulled(wait(required=0, min_applied=None))
    assert s.covers == -1 and s.needs_pull(wait(required=0, min_applied=None))


def test_a_wait_is_remembered_with_its_staleness() -> None:
    s = joined()
    w = wait(required=3, min_applied=3, staleness=2)
    s.waited(w)
    assert (s.last_wait, s.staleness) == (w, 2)


# -- ticking when idle ------------------------------------------------------------------------------------

def test_an_idle_member_ticks_only_when_a_live_member_caught_up_with_its_clock() -> None:
    s = joined(start=5)
    live = {"m1", "m2", "gone"}
    assert not s.should_tick("ssp", live, {"m1": 4, "m2": 4})
    assert s.should_tick("ssp", live, {"m1": 4, "m2": 5})
    assert not s.should_tick("ssp", {"m1"}, {"m1": 4, "m2": 9})  # m2 left: nobody waits on us
    assert not s.should_tick("asp", live, {"m1": 4, "m2": 9})    # nobody ever waits under ASP
    assert not s.should_tick("bsp", live, {"m2": 9})            # we never pushed: not counted


# -- progress -----------------------------------------------------------------------------------------------

def test_heartbeat_stats_cover_the_window_since_the_last_one() -> None:
    p = Progress(started=100.0)
    p.stepped(64, 0.5, 2.0)
    p.stepped(36, 0.3, 1.0)
    p.pushed(1, 400, 0)
    stats = p.heartbeat_stats(102.0, clock=7, staleness=1, accuracy=0.9, lag={0: 3, 1: 4})
    assert stats["records_per_s"] == 50.0 and stats["samples"] == 100
    assert stats["step_time_s"] == pytest.approx(0.4) and stats["bytes_per_step"] == 200
    assert stats["loss"] == pytest.approx((1 - LOSS_EMA_WEIGHT) * 2.0 + LOSS_EMA_WEIGHT * 1.0)
    assert (stats["clock"], stats["staleness"], stats["accuracy"], stats["lag"]) == (7, 1, 0.9, 7)
    empty = p.heartbeat_stats(104.0, clock=7, staleness=1, accuracy=None, lag={})
    assert empty["records_per_s"] == 0 and "step_time_s" not in empty and "accuracy" not in empty


def test_a_non_finite_loss_is_not_sent() -> None:
    p = Progress(started=0.0)
    p.stepped(1, 0.1, float("nan"))
    assert "loss" not in p.heartbeat_stats(1.0, clock=1, staleness=0, accuracy=None, lag={})


def test_freshness_is_sampled_once_the_push_is_applied() -> None:
    p = Progress(started=0.0)
    p.pushed(1, 10, produced_ts_ms=1_000)
    p.pushed(2, 10, produced_ts_ms=1_500)
    p.pushed(3, 10, produced_ts_ms=0)  # unknown produce time: no sample
    p.applied(1, now_ms=2_000)
    assert p.heartbeat_stats(1.0, clock=3, staleness=0, accuracy=None, lag={})["freshness_s"] == [1.0]
    p.applied(3, now_ms=3_000)
    assert p.heartbeat_stats(2.0, clock=3, staleness=0, accuracy=None, lag={})["freshness_s"] == [1.5]


def test_phases_are_reported_in_ms_per_step_every_report_period() -> None:
    p = Progress(started=0.0)
    for _ in range(PHASE_REPORT_STEPS):
        assert p.phase_report() is None
        p.phase("compute", 0.002)
        p.phase("pull", 0.001)
        p.stepped(1, 0.003, 1.0)
    report = p.phase_report()
    assert report == pytest.approx({"compute": 2.0, "pull": 1.0})
    assert p.phase_report() is None  # counts restart
