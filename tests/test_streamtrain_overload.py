"""The keeping-up verdict of online training (``streamtrain.overload``): pure, no servers."""

from __future__ import annotations

import pytest

from streamtrain.overload import LagSample, LagWindow, Trend, assess, sample_from_status


def stream(input_per_s: float, consumed_per_s: float, *, seconds: int = 20, backlog: int = 0,
           start_s: float = 100.0) -> list[LagSample]:
    """One sample a second of a topic written at ``input_per_s`` and committed at ``consumed_per_s``
    messages/s, starting with ``backlog`` messages not yet committed."""
    out = []
    for i in range(seconds + 1):
        end = 10_000 + backlog + round(input_per_s * i)
        committed = 10_000 + round(consumed_per_s * i)
        out.append(LagSample(start_s + i, end, committed, max(0, end - committed)))
    return out


def test_falling_behind_says_how_many_trainers_to_add() -> None:
    # 1000 records/s in, two trainers doing 300 records/s each: the lag grows by 400 records/s.
    v = assess(stream(1000, 600), trainers=2, partitions=8)
    assert v.trend is Trend.FALLING_BEHIND
    assert v.lag_slope_per_s == pytest.approx(400)
    assert v.input_per_s == pytest.approx(1000) and v.consumed_per_s == pytest.approx(600)
    assert v.per_trainer_per_s == pytest.approx(300)
    # ceil(1000 * 1.2 / 300) = 4 trainers needed, 2 running: add 2
    assert v.add_trainers == 2
    line = v.line()
    assert line.startswith("falling behind: lag +400 records/s")
    assert "consumption 600/s vs input 1,000/s" in line
    assert "add about 2 trainers (each does ~300 records/s)" in line
    assert "partitions" not in line


def test_records_per_message_turns_offsets_into_records() -> None:
    v = assess(stream(50, 30), trainers=1, records_per_message=32)  # shards of 32 records
    assert v.trend is Trend.FALLING_BEHIND
    assert v.input_per_s == pytest.approx(1600) and v.consumed_per_s == pytest.approx(960)
    assert v.add_trainers == 1  # ceil(1600 * 1.2 / 960) = 2
    assert v.lag_records == 20 * 20 * 32


def test_advice_names_the_partition_limit() -> None:
    v = assess(stream(1000, 250), trainers=2, partitions=4)
    assert v.add_trainers == 8  # ceil(1000 * 1.2 / 125) = 10 trainers, more than the 4 partitions
    assert "partitions (the topic has 4; a trainer needs one)" in v.line()


def test_stalled_trainers_get_no_made_up_count() -> None:
    v = assess(stream(500, 0), trainers=2)
    assert v.trend is Trend.FALLING_BEHIND and v.add_trainers is None and v.per_trainer_per_s is None
    assert "consume nothing" in v.line()


def test_keeping_up_with_noise() -> None:
    samples = stream(1000, 1000)
    jitter = [0, 40, -30, 10, 64, -20, 0, 32, -10, 5, 0, 40, -30, 10, 64, -20, 0, 32, -10, 5, 0]
    noisy = [LagSample(s.t_s, s.end, s.committed - j, s.lag + j) for s, j in zip(samples, jitter, strict=True)]
    v = assess(noisy, trainers=2)
    assert v.trend is Trend.KEEPING_UP and v.add_trainers == 0
    assert v.line().startswith("keeping up: lag ")


def test_a_quiet_stream_keeps_up() -> None:
    v = assess(stream(0, 0), trainers=1)
    assert v.trend is Trend.KEEPING_UP and v.input_per_s == 0


def test_draining_a_backlog() -> None:
    # 20,000 messages behind, consuming 1500/s against 1000/s in: the backlog shrinks by 500/s.
    v = assess(stream(1000, 1500, backlog=20_000), trainers=3)
    assert v.trend is Trend.CATCHING_UP
    assert v.lag_slope_per_s == pytest.approx(-500)
    assert v.lag_records == 10_000
    assert v.drain_s == pytest.approx(20)
    assert v.add_trainers == 0
    assert v.line().startswith("catching up: lag 10,000 records")


def test_too_few_samples_or_too_short_a_span() -> None:
    assert assess([], trainers=2).trend is Trend.MEASURING
    assert assess(stream(1000, 100, seconds=3), trainers=2).trend is Trend.MEASURING  # 4 samples
    dense = [LagSample(100 + i / 10, 1000 + 50 * i, 1000, 50 * i) for i in range(20)]  # 1.9 s
    v = assess(dense, trainers=2)
    assert v.trend is Trend.MEASURING and v.lag_records == 950
    assert "measuring" in v.line()


def test_bad_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="records_per_message"):
        assess(stream(1, 1), trainers=1, records_per_message=0)
    with pytest.raises(ValueError, match="trainers"):
        assess(stream(1, 1), trainers=-1)
    with pytest.raises(ValueError, match="window_s"):
        LagWindow(0)


def test_window_is_bounded_and_restarts_on_a_new_topic() -> None:
    window = LagWindow(window_s=10)
    for s in stream(1000, 600, seconds=60):
        window.add(s)
    assert len(window.samples) == 11
    assert window.samples[0].t_s == 150
    assert window.verdict(2).trend is Trend.FALLING_BEHIND
    window.add(LagSample(161, 5, 5, 0))  # end offsets went back: another topic
    assert len(window.samples) == 1 and window.verdict(2).trend is Trend.MEASURING


def test_sample_from_status() -> None:
    status = {"partitions": [
        {"partition": 0, "committed": 10, "beginning": 0, "end": 15, "lag": 5},
        {"partition": 1, "committed": None, "beginning": 3, "end": 7, "lag": 4},
    ]}
    assert sample_from_status(status, 1.5) == LagSample(1.5, 22, 13, 9)
    status["partitions"][1]["end"] = None  # Kafka unreachable
    assert sample_from_status(status, 2.0) is None
    assert sample_from_status({}, 2.0) is None
