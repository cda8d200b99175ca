"""The trainer's state rules (``trainers/state.py``) and its reports (``trainers/progress.py``):
pure, no servers, no sleeping."""

from __future__ import annotations

import pytest

from coordinator.assignment import Assignment, JobConfig
from services.clocks import ClockWait
from trainers.progress import LOSS_EMA_WEIGHT, PHASE_REPORT_STEPS, Progress
from trainers.state import Adopt, Move, Outcome, Push, Resync, StateError, TrainerState, low_covered, needs_pull


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
    s.assigned(s.wanted)  # type: ignore[arg-type]  # joined() set it
    newer = assignment(generation=2)
    s.heard(newer)
    assert s.follow() is Move.TRAIN
    assert s.assignment is newer


def test_other_partitions_need_a_reassignment_and_training_resumes_after_it() -> None:
    s = joined()
    s.assigned(s.wanted)  # type: ignore[arg-type]  # joined() set it
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
    s.assigned(s.wanted)  # type: ignore[arg-type]  # joined() set it
    s.heard(assignment(partitions=(), generation=2, state="draining"))
    assert s.follow() is Move.LEAVE


def test_a_lost_lease_keeps_the_current_assignment_until_a_new_one_is_heard() -> None:
    s = joined()
    a = s.wanted
    s.assigned(a)  # type: ignore[arg-type]  # joined() set it
    s.lease_lost()
    assert s.wanted is None and s.follow() is Move.TRAIN
    s.joined("m2", 9, assignment(member="m2", generation=3))
    assert s.step_allowed() is False  # a batch polled across the re-registration is dropped
    assert s.follow() is Move.REASSIGN


# -- the clock and the push in flight -----------------------------------------------------------------

FEEDBACK = object()
"""The error-feedback state a push leaves behind: opaque to the state, handed back in Adopt."""


def test_a_push_takes_the_clock_and_the_next_step_moves_on() -> None:
    s = joined(start=5)
    assert s.pushing() == 5
    assert s.clock == 6 and s.in_flight == Push(5, "m1") and s.unsettled is None
    with pytest.raises(StateError, match="still in flight"):
        s.pushing()
    assert s.push_ended(Outcome.COMMITTED, FEEDBACK) == [Adopt(FEEDBACK)]
    assert (s.pending, s.last_pushed) == (None, 5)


def test_a_refused_push_drops_its_feedback_and_resync_resumes_after_the_last_committed() -> None:
    s = joined(start=5)
    s.pushing()
    s.push_ended(Outcome.COMMITTED, FEEDBACK)                        # clock 5 committed
    s.pushing()
    assert s.push_ended(Outcome.REFUSED, FEEDBACK) == [Resync(6)]   # clock 6 refused (fenced): no Adopt
    assert (s.pending, s.last_pushed) == (None, 5)
    s.clock = 9                                                     # steps 7 and 8 were computed, never pushed
    s.resync()
    assert (s.clock, s.last_pushed, s.last_wait) == (6, 5, None)


def test_resync_with_a_push_in_flight_or_unsettled_is_a_bug() -> None:
    s = joined()
    s.pushing()
    with pytest.raises(StateError, match="settle the push at clock 5 \\(in flight\\)"):
        s.resync()
    s.push_ended(Outcome.UNREACHABLE, FEEDBACK)
    with pytest.raises(StateError, match="settle the push at clock 5 \\(unsettled\\)"):
        s.resync()


def test_ending_a_push_without_one_in_flight_is_a_bug() -> None:
    with pytest.raises(StateError, match="no push in flight"):
        joined().push_ended(Outcome.COMMITTED, FEEDBACK)
    s = joined()
    s.pushing()
    s.push_ended(Outcome.UNREACHABLE, FEEDBACK)
    with pytest.raises(StateError, match="no push in flight"):  # an unsettled push is not in flight
        s.push_ended(Outcome.COMMITTED, FEEDBACK)


def test_a_push_before_joining_is_a_bug() -> None:
    with pytest.raises(StateError, match="before joining"):
        TrainerState().pushing()


@pytest.mark.parametrize("outcome", list(Outcome))
def test_a_push_made_under_an_earlier_id_is_moot_whatever_its_outcome(outcome: Outcome) -> None:
    """The lease was lost and the trainer registered anew while the push was in flight: the old id's
    clocks are gone, its feedback belongs to the old Pusher, and there is nothing to resync or ask."""
    s = joined(start=5)
    s.pushing()                                 # clock 5 as m1
    s.joined("m2", 3, assignment(member="m2"))  # lease lost, registered anew while it was in flight
    assert s.push_ended(outcome, FEEDBACK) == []
    assert (s.pending, s.last_pushed, s.clock) == (None, 2, 3)
    assert s.pushing() == 3 and s.in_flight == Push(3, "m2")


# -- outages -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("committed, last_pushed, adopted", [(True, 5, [Adopt(FEEDBACK)]), (False, 4, [])])
def test_an_unsettled_push_counts_and_keeps_its_feedback_only_when_was_committed_says_so(
        committed: bool, last_pushed: int, adopted: list[Adopt]) -> None:
    s = joined(start=5)
    s.pulled(low_covered(wait(required=3, min_applied=4).min_applied))
    s.pushing()
    assert s.push_ended(Outcome.UNREACHABLE, FEEDBACK) == []  # nothing to do until Redis answers
    assert s.unsettled == Push(5, "m1", unsettled=True, feedback=FEEDBACK) and s.in_flight is None
    with pytest.raises(StateError, match="unsettled"):
        s.pushing()
    assert s.outage_settled(committed) == adopted
    assert (s.pending, s.last_pushed) == (None, last_pushed)
    assert s.covers is None  # the replica is not trusted after an outage: the next step pulls in full
    s.resync()
    assert s.clock == last_pushed + 1


def test_an_outage_with_nothing_unsettled_only_drops_the_replica() -> None:
    s = joined(start=5)
    s.pulled(low_covered(wait(required=3, min_applied=4).min_applied))
    assert s.outage_settled(None) == []
    assert (s.covers, s.last_pushed, s.last_wait) == (None, 4, None)


def test_an_unsettled_push_must_be_asked_about_and_one_in_flight_settled_first() -> None:
    s = joined(start=5)
    s.pushing()
    with pytest.raises(StateError, match="settle the push at clock 5 before the outage"):
        s.outage_settled(None)
    s.push_ended(Outcome.UNREACHABLE, FEEDBACK)
    with pytest.raises(StateError, match="ask was_committed about the unsettled push at clock 5"):
        s.outage_settled(None)


def test_an_unsettled_push_of_an_id_lost_during_the_outage_is_moot_even_if_committed() -> None:
    """The heartbeat task registered anew while the outage was ridden out: was_committed is asked
    about the old id's push (its member id is recorded with it), and the answer moves nothing."""
    s = joined(start=5)
    s.pushing()
    s.push_ended(Outcome.UNREACHABLE, FEEDBACK)
    asked = s.unsettled
    s.joined("m2", 8, assignment(member="m2"))
    assert asked is not None and (asked.member_id, asked.clock) == ("m1", 5)
    assert s.outage_settled(True) == []
    assert (s.pending, s.last_pushed, s.clock) == (None, 7, 8)


# -- pulls ----------------------------------------------------------------------------------------------

def test_a_pull_is_needed_until_the_replica_covers_the_bound() -> None:
    s = joined()
    assert s.needs_pull(wait(required=3, min_applied=3))  # never pulled
    s.pulled(low_covered(wait(required=3, min_applied=4).min_applied))
    assert s.covers == 4
    assert not s.needs_pull(wait(required=4, min_applied=4))
    assert s.needs_pull(wait(required=5, min_applied=5))


def test_asp_always_pulls_the_newest() -> None:
    assert needs_pull(100, wait(required=None, min_applied=3))


def test_a_pull_with_nobody_participating_covers_nothing_yet() -> None:
    s = joined()
    s.pulled(low_covered(wait(required=0, min_applied=None).min_applied))
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
    assert "auc" not in empty and "log_loss" not in empty  # not a binary model
    binary = p.heartbeat_stats(105.0, clock=7, staleness=1, accuracy=0.6, lag={}, auc=0.71, log_loss=0.62)
    assert (binary["accuracy"], binary["auc"], binary["log_loss"]) == (0.6, 0.71, 0.62)


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


def test_the_row_cache_hit_rate_covers_the_window_since_the_last_heartbeat() -> None:
    p = Progress(started=0.0)
    stats = p.heartbeat_stats(1.0, clock=1, staleness=0, accuracy=None, lag={}, row_cache=(30, 10))
    assert stats["row_cache_hit_rate"] == 0.75
    stats = p.heartbeat_stats(2.0, clock=2, staleness=0, accuracy=None, lag={}, row_cache=(40, 40))
    assert stats["row_cache_hit_rate"] == 0.25  # 10 hits of 40 lookups since, not 40 of 80 overall
    idle = p.heartbeat_stats(3.0, clock=2, staleness=0, accuracy=None, lag={}, row_cache=(40, 40))
    assert "row_cache_hit_rate" not in idle  # no lookup in the window: nothing to report
    fresh = p.heartbeat_stats(4.0, clock=3, staleness=0, accuracy=None, lag={}, row_cache=(1, 3))
    assert fresh["row_cache_hit_rate"] == 0.25  # the counts went back (a new cache): counted anew
    dense = p.heartbeat_stats(5.0, clock=3, staleness=0, accuracy=None, lag={})
    assert "row_cache_hit_rate" not in dense


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
