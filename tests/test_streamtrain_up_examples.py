"""``up --example`` and ``--target-auc``, without servers: what an example sets, what the user's flags
and variables keep, and which target stops a binary model's run."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from common import settings as cfg
from streamtrain.cli import build_parser
from streamtrain.cluster import Endpoints, commands, service_settings
from streamtrain.examples import CLICKS_SOURCE, CLICKS_TARGET_AUC, EXAMPLES, MOVIELENS_TARGET_AUC
from streamtrain.settings import UpSettings
from streamtrain.up import Outcome, Task, _ending, cluster_spec, exit_code, has_target, reached_target, settings_of

BINARY, DIGITS = Task(classification=True, binary=True), Task(classification=True)


def _up(*flags: str, environ: dict[str, str] | None = None) -> UpSettings:
    return settings_of(build_parser("up").parse_args(list(flags)), environ or {})


def test_the_movielens_example_sets_its_job_and_the_users_flags_and_variables_win() -> None:
    s = _up("--example", "movielens")
    assert s.source == "movielens" and s.model.startswith("dlrm?schema=movielens")
    assert s.target_auc == MOVIELENS_TARGET_AUC and all(getattr(s, k) == v for k, v in EXAMPLES["movielens"].items())
    spec = cluster_spec(s, environ={})
    assert (spec.job, spec.topic, spec.producer.source, spec.trainer.eval_source) == (
        "movielens", "movielens", "movielens", "movielens")
    assert spec.coordinator.table_consistency == "asp" and spec.trainer.model == s.model
    mine = _up("--example", "movielens", "--trainers", "1", "--target-auc", "0.6", "--lr", "0.01",
               environ={"STREAMTRAIN_CODEC": "int8"})
    assert (mine.trainers, mine.target_auc, mine.lr, mine.codec) == (1, 0.6, 0.01, "int8")
    assert mine.source == "movielens"  # the rest stays the example's
    from_env = _up(environ={"STREAMTRAIN_EXAMPLE": "movielens"})
    assert from_env.source == "movielens"
    assert _up() == cfg.from_args(UpSettings, {}, environ={})  # digits: the defaults themselves
    assert cluster_spec(_up(), environ={}).job == "digits"
    forever = cluster_spec(_up("--example", "movielens", "--forever"), environ={})
    assert forever.producer.source == "movielens?repeat=0"  # online: pass after pass


def test_target_auc_is_checked_against_the_model() -> None:
    with pytest.raises(cfg.SettingsError, match="--target-auc / STREAMTRAIN_TARGET_AUC: the AUC needs a binary model"):
        _up("--target-auc", "0.8")  # digits: a ten-class MLP
    with pytest.raises(cfg.SettingsError, match=r"--target-auc / STREAMTRAIN_TARGET_AUC: must be <= 1\.0"):
        _up("--example", "movielens", "--target-auc", "1.5")
    with pytest.raises(cfg.SettingsError, match="STREAMTRAIN_TARGET_AUC: expected float"):
        _up("--example", "movielens", environ={"STREAMTRAIN_TARGET_AUC": "high"})
    assert _up("--model", "dlrm?features=2&dense=1", "--target-auc", "0.75").target_auc == 0.75


def test_a_target_auc_stops_a_binary_run_in_place_of_the_accuracy_target() -> None:
    s = _up("--example", "movielens", "--target-auc", "0.72")
    assert has_target(s, BINARY)
    assert not reached_target({"auc": 0.719, "accuracy": 0.99}, s, BINARY)  # accuracy is not the target
    assert reached_target({"auc": 0.72, "accuracy": 0.5}, s, BINARY)
    assert not reached_target({"accuracy": 0.99}, s, BINARY)  # no AUC yet
    assert exit_code(Outcome.CONSUMED, s, BINARY) == 1 and exit_code(Outcome.TARGET, s, BINARY) == 0
    assert _ending(s, Outcome.CONSUMED, BINARY) == "the stream ended; target AUC 0.72: NOT reached"
    plain = _up("--model", "dlrm?features=2&dense=1")  # a binary model without --target-auc: accuracy, as before
    assert reached_target({"auc": 0.5, "accuracy": 0.96}, plain, BINARY)
    assert not reached_target({"auc": 0.99, "accuracy": 0.9}, plain, BINARY)
    with_loss = _up("--example", "movielens", "--target-loss", "0.6")
    assert reached_target({"auc": 0.5, "loss": 0.59}, with_loss, BINARY)
    assert _ending(with_loss, Outcome.TARGET, BINARY) == "target AUC 0.7 or loss 0.6: reached"
    assert reached_target({"accuracy": 0.96}, _up(), DIGITS) and not reached_target({"accuracy": 0.9}, _up(), DIGITS)


def test_local_steps_reach_the_job_and_what_they_cannot_run_is_refused_before_anything_starts() -> None:
    spec = cluster_spec(_up("--local-steps", "16", "--codec", "fp16", "--outer-lr", "0.5"), environ={})
    assert (spec.coordinator.local_steps, spec.coordinator.outer_lr, spec.coordinator.outer_momentum) == (16, 0.5, 0.9)
    assert cluster_spec(_up(), environ={}).coordinator.local_steps == 1  # the default: a push per step
    with pytest.raises(cfg.SettingsError, match=r"--local-steps.*cannot run with codec 'topk\+fp16'.*dense codec"):
        _up("--local-steps", "16")  # the job's default codec sparsifies
    with pytest.raises(cfg.SettingsError, match="local-steps"):
        _up("--local-steps", "0")
    with pytest.raises(cfg.SettingsError, match=r"need a dense model; dlrm.* has embedding tables"):
        _up("--example", "movielens", "--local-steps", "4")  # the example's codec (fp16) is dense: its tables are not


def test_serve_starts_replicas_that_score_the_stream_and_every_process_gets_a_metrics_port() -> None:
    """``--serve N`` (one by default; ``STREAMTRAIN_UP_SERVE``) becomes the cluster's replicas, the first
    scoring a sample of the stream; every process serves metrics; the producer's token stays off command lines."""
    from pathlib import Path

    from streamtrain.cluster import Endpoints, commands
    from streamtrain.credentials import prometheus_targets, shell_exports

    spec = cluster_spec(_up(), environ={})
    assert (spec.replicas, spec.score_served, spec.metrics_ports) == (1, True, True)
    assert cluster_spec(_up("--serve", "0"), environ={}).replicas == 0
    assert cluster_spec(_up(environ={"STREAMTRAIN_UP_SERVE": "3"}), environ={}).replicas == 3
    with pytest.raises(cfg.SettingsError, match="serve"):
        _up("--serve", "-1")
    at = Endpoints(redis_url="redis://:pw@127.0.0.1:1/0", bootstrap="127.0.0.1:2", coordinator_port=3,
                   admin_token="adm", job_token="jobtok", workdir=Path("/tmp/x"))
    scoring = replace(spec, producer=replace(spec.producer, score_url="http://127.0.0.1:9/"))
    args, env = commands(scoring, at)["producer"]
    assert "--score-url=http://127.0.0.1:9/" in args and not any("jobtok" in a for a in args)
    assert env["STREAMTRAIN_PRODUCE_SCORE_TOKEN"] == "jobtok"  # the job token, in its environment
    assert commands(spec, at)["producer"][1]["STREAMTRAIN_PRODUCE_SCORE_TOKEN"] == ""  # no URL: no token
    text = shell_exports(at, "digits", serve_urls=["http://127.0.0.1:5", "http://127.0.0.1:6"])
    assert "export STREAMTRAIN_SERVE_URL=http://127.0.0.1:5\n" in text
    assert "export STREAMTRAIN_SERVE_URLS='http://127.0.0.1:5 http://127.0.0.1:6'\n" in text
    assert "SERVE_URL" not in shell_exports(at, "digits")
    assert prometheus_targets("127.0.0.1", [("ps", "ps0", 7), ("serve", "serve-4", 8)]) == [
        {"targets": ["127.0.0.1:7"], "labels": {"job": "streamtrain", "service": "ps", "instance_name": "ps0"}},
        {"targets": ["127.0.0.1:8"], "labels": {"job": "streamtrain", "service": "serve", "instance_name": "serve-4"}}]


def test_the_clicks_example_joins_impressions_and_clicks_into_the_training_topic() -> None:
    """``--example clicks``: no shard producer; the events producer writes the clicks stream's train split as
    impressions and delayed clicks to the joiner's inputs, the joiner labels them for the job's topic, and the
    job is scored on the test split the events leave out; ``--max-records``, ``--rate`` and ``--negative-rate``
    reach them."""
    s = _up("--example", "clicks", "--max-records", "5000", "--rate", "100", "--negative-rate", "0.25")
    assert s.join and s.source == CLICKS_SOURCE and s.target_auc == CLICKS_TARGET_AUC
    spec = cluster_spec(s, environ={})
    at = Endpoints(redis_url="redis://r:1/0", bootstrap="k:9", coordinator_port=7, admin_token="a", job_token="j",
                   workdir=Path("/w"))
    lines = commands(spec, at)
    assert spec.producer is None and "producer" not in lines and {"join", "events"} <= set(lines)
    assert spec.events is not None and spec.join is not None
    assert (spec.events.stream, spec.events.limit, spec.events.rate_per_s, spec.events.train_split) == (
        CLICKS_SOURCE, 5000, 100.0, True)
    assert spec.events.rate == pytest.approx(140.0) and spec.events.window_s == spec.join.window_s
    services = service_settings(spec, at)
    assert services.join is not None and services.events is not None
    assert (services.join.topic, services.join.bootstrap, services.join.partitions, services.join.negative_rate) == (
        "clicks", "k:9", spec.partitions, 0.25)
    assert (services.join.coordinator_url, services.join.job_token) == ("http://127.0.0.1:7", "j")
    assert (services.events.impressions, services.events.feedback) == (services.join.impressions,
                                                                     services.join.feedback_topics[0])
    args, env = lines["join"]  # the job token travels in the joiner's environment, not on its command line
    assert env == {"STREAMTRAIN_JOB_TOKEN": "j"} and not any("token" in a for a in args)
    assert spec.trainer.eval_source == CLICKS_SOURCE  # its test split: what the events leave out


def test_join_needs_a_clicks_source_and_a_binary_model_and_downsampling_needs_join() -> None:
    with pytest.raises(cfg.SettingsError, match="--join / STREAMTRAIN_UP_JOIN: its impressions come from a clicks"):
        _up("--join", "--model", "dlrm?features=2&dense=1", "--source", "synthetic")
    with pytest.raises(cfg.SettingsError, match="--join / STREAMTRAIN_UP_JOIN: joined records are clicked or not"):
        _up("--join", "--source", "clicks")  # digits' MLP: ten classes
    with pytest.raises(cfg.SettingsError, match="--negative-rate / STREAMTRAIN_JOIN_NEGATIVE_RATE: downsampling"):
        _up("--negative-rate", "0.5")
    with pytest.raises(cfg.SettingsError, match="clicks --source"):
        _up("--example", "clicks", "--source", "clicks?limit=5")  # the events producer's limit is --max-records
