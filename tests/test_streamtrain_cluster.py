"""The local topology's command lines and defaults, without starting anything.

Every command line :class:`streamtrain.cluster.LocalCluster` runs must parse with
that service's real parser and give the service exactly the settings of the
:class:`ClusterSpec` (so a renamed flag fails here, not at run time), secrets stay
off the command lines, and ``streamtrain up``'s job defaults are the services' own.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import replace
from pathlib import Path

import pytest

from common import settings as cfg
from coordinator.settings import CoordinatorSettings
from datastream.settings import ProduceSettings
from services.settings import ServerSettings
from streamtrain.cli import build_parser
from streamtrain.cluster import LOCAL_STREAM, ClusterSpec, Endpoints, commands, service_settings
from streamtrain.settings import UpSettings
from streamtrain.up import cluster_spec
from trainers.settings import TrainerSettings

AT = Endpoints(redis_url="redis://:redis-password@127.0.0.1:6390/0", bootstrap="127.0.0.1:9099",
               coordinator_port=8799, admin_token="admin-secret", job_token="job-secret",
               workdir=Path("/tmp/cluster"))
SECRETS = ("redis-password", "admin-secret", "job-secret")

SPECS = {
    "default": ClusterSpec(),
    "two groups, bsp, no producer, extra trainer flags": ClusterSpec(
        job="j2", topic="t2", trainers=3, producer=None, extra_trainer_args=("--prefetch", "8"),
        coordinator=CoordinatorSettings(consistency="bsp", partitions=6, ps_groups=2, lease_ms=2000,
                                        table_consistency="asp", table_staleness=8),
        trainer=replace(ClusterSpec().trainer, batch_size=32, eval_source=""),
        ps=ServerSettings(checkpoint_every=50, metrics_port=9500)),
    "bounded, paced producer": ClusterSpec(producer=replace(LOCAL_STREAM, limit=500, rate=100.0)),
}


def settings_of(which: str, spec: ClusterSpec) -> object:
    services = service_settings(spec, AT)
    if which.startswith("ps"):
        return services.ps[int(which[2:])]
    return getattr(services, which)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_every_command_line_parses_with_the_services_parser_into_the_specs_settings(spec: ClusterSpec) -> None:
    lines = commands(spec, AT)
    assert set(lines) == {"coordinator", "trainer", "serve", *(f"ps{g}" for g in range(spec.ps_groups)),
                          *(["producer"] if spec.producer is not None else [])}
    for which, (args, env) in lines.items():
        command, flags = args[0], args[1:]
        try:
            parsed = build_parser(command).parse_args(flags)
        except SystemExit:  # argparse: a flag the service does not have
            pytest.fail(f"{which}: streamtrain {' '.join(args)} does not parse")
        expected = settings_of(which, spec)
        if which == "trainer" and spec.extra_trainer_args:
            expected = replace(expected, prefetch=8)  # the extra flags come last and win
        assert cfg.from_args(type(expected), parsed, environ=env) == expected, which
        assert not any(secret in arg for arg in args for secret in SECRETS), f"{which}: a secret on {args}"


def test_the_cluster_fills_in_addresses_job_topic_tokens_and_groups() -> None:
    spec = SPECS["two groups, bsp, no producer, extra trainer flags"]
    services = service_settings(spec, AT)
    c = services.coordinator
    assert (c.job, c.topic, c.redis_url, c.kafka_bootstrap, c.port) == ("j2", "t2", AT.redis_url, AT.bootstrap, 8799)
    assert (c.admin_token, c.job_token, c.ps_groups, c.consistency) == ("admin-secret", "job-secret", 2, "bsp")
    assert [(s.group, s.groups, s.job, s.metrics_port) for s in services.ps] == [(0, 2, "j2", 9500), (1, 2, "j2", 9501)]
    assert all(s.checkpoint_dir == "/tmp/cluster/checkpoints" and s.checkpoint_every == 50 for s in services.ps)
    t = services.trainer
    assert (t.job, t.coordinator_url, t.job_token, t.kafka_bootstrap) == ("j2", "http://127.0.0.1:8799", "job-secret",
                                                                          AT.bootstrap)
    assert services.producer is None
    p = service_settings(ClusterSpec(), AT).producer
    assert (p.topic, p.bootstrap, p.partitions) == ("digits", AT.bootstrap, 4)


def test_the_cluster_host_is_what_the_coordinator_binds_and_the_services_dial() -> None:
    at = replace(AT, host="10.213.0.1")
    services = service_settings(ClusterSpec(host="10.213.0.1"), at)
    assert (services.coordinator.host, services.trainer.coordinator_url) == ("10.213.0.1", "http://10.213.0.1:8799")
    assert service_settings(ClusterSpec(), AT).coordinator.host == "127.0.0.1"  # loopback unless told
    wildcard = ClusterSpec(host="10.213.0.1", coordinator=CoordinatorSettings(host="0.0.0.0"))
    assert service_settings(wildcard, at).coordinator.host == "0.0.0.0"  # its own choice stays


def test_the_cluster_defaults_are_the_services_defaults() -> None:
    spec = ClusterSpec()
    assert spec.coordinator == CoordinatorSettings()
    assert spec.ps == ServerSettings()
    local_choices = {"threads": 1, "eval_source": "digits"}  # LOCAL_TRAINER: the only departures
    assert spec.trainer == replace(TrainerSettings(), **local_choices)
    assert spec.producer == replace(ProduceSettings(), source="digits?repeat=60", split="train", shard_size=32,
                                    progress=False)


def up(**given: object) -> UpSettings:
    return cfg.from_args(UpSettings, argparse.Namespace(**given), environ={})


def test_up_takes_the_job_defaults_from_the_services() -> None:
    assert "--ps-groups" in build_parser("up").format_help()  # and the help (argparse %-formats it) renders
    spec = cluster_spec(up(), environ={})
    # nothing re-spelt: up's defaults are the local cluster's, but for what only up turns on (a replica
    # that the producer scores on, a metrics port per process)
    assert (spec.replicas, spec.score_served, spec.metrics_ports) == (1, True, True)
    assert replace(spec, replicas=0, score_served=False, metrics_ports=False) == ClusterSpec()
    for name in ("partitions", "consistency", "staleness", "codec", "optimizer", "lr", "ps_groups",
                 "table_consistency", "table_staleness"):
        mine = next(f for f in dataclasses.fields(UpSettings) if f.name == name)
        theirs = next(f for f in dataclasses.fields(CoordinatorSettings) if f.name == name)
        assert (mine.default, mine.metadata["env"]) == (theirs.default, theirs.metadata["env"]), name


def test_up_flags_reach_the_services() -> None:
    spec = cluster_spec(up(consistency="asp", staleness=0, codec="int8", optimizer="adam", lr=0.001, ps_groups=3,
                           partitions=6, trainers=3, topk_density=0.05, model="mlp-2m", eval_source="",
                           source="synthetic?seed=1&repeat=2", max_records=700, dense_below=300,
                           density_warmup_steps=50), environ={})
    c = spec.coordinator
    assert (c.consistency, c.staleness, c.codec, c.optimizer, c.lr, c.ps_groups, c.partitions) == (
        "asp", 0, "int8", "adam", 0.001, 3, 6)
    assert (spec.trainers, spec.ps_groups, spec.trainer.topk_density, spec.trainer.model, spec.trainer.eval_source) \
        == (3, 3, 0.05, "mlp-2m", "synthetic?seed=1")  # no --eval-source: one pass of --source
    assert (spec.trainer.dense_below, spec.trainer.density_warmup_steps) == (300, 50)
    trainer = commands(spec, AT)["trainer"][0]  # on the trainers' command lines
    assert "--dense-below=300" in trainer and "--density-warmup-steps=50" in trainer
    assert (spec.producer.source, spec.producer.limit, spec.producer.rate) == ("synthetic?seed=1&repeat=2", 700, None)
    assert len([k for k in commands(spec, AT) if k.startswith("ps")]) == 3
    assert (c.table_consistency, c.table_staleness) == (None, None)  # unset: the tables follow the dense part


def test_up_table_flags_reach_the_coordinators_command_line() -> None:
    """``up --table-consistency asp --table-staleness 8``, parsed by up's real parser, reaches the
    coordinator's command line, which its real parser reads back."""
    parsed = build_parser("up").parse_args(["--table-consistency", "asp", "--table-staleness", "8"])
    spec = cluster_spec(cfg.from_args(UpSettings, parsed, environ={}), environ={})
    assert (spec.coordinator.table_consistency, spec.coordinator.table_staleness) == ("asp", 8)
    args, env = commands(spec, AT)["coordinator"]
    assert "--table-consistency=asp" in args and "--table-staleness=8" in args
    coordinator = cfg.from_args(CoordinatorSettings, build_parser("coordinator").parse_args(args[1:]), environ=env)
    assert (coordinator.table_consistency, coordinator.table_staleness) == ("asp", 8)
    from_env = cfg.from_args(UpSettings, build_parser("up").parse_args([]), environ={
        "STREAMTRAIN_TABLE_CONSISTENCY": "bsp", "STREAMTRAIN_TABLE_STALENESS": "0"})
    assert (from_env.table_consistency, from_env.table_staleness) == ("bsp", 0)
    default = commands(ClusterSpec(), AT)["coordinator"][0]
    assert not any(a.startswith("--table-") for a in default)  # unset stays unset, not a flag
    with pytest.raises(SystemExit):
        build_parser("up").parse_args(["--table-consistency", "eventual"])
    with pytest.raises(cfg.SettingsError, match="--table-staleness / STREAMTRAIN_TABLE_STALENESS: must be >= 0"):
        cfg.from_args(UpSettings, build_parser("up").parse_args(["--table-staleness", "-1"]), environ={})


def test_up_passes_the_services_variables_on_over_the_local_defaults() -> None:
    spec = cluster_spec(up(), environ={"STREAMTRAIN_DEVICE": "cpu", "STREAMTRAIN_PS_AUDIT_HORIZON_S": "60",
                                       "STREAMTRAIN_THREADS": "2"})
    assert (spec.trainer.device, spec.trainer.threads, spec.ps.audit_horizon_s) == ("cpu", 2, 60.0)
    assert spec.trainer.eval_source == "digits"  # the local defaults stay where no variable is set
    with pytest.raises(cfg.SettingsError, match="STREAMTRAIN_THREADS"):
        cluster_spec(up(), environ={"STREAMTRAIN_THREADS": "many"})


def test_up_redis_cluster_reaches_the_spec_and_the_cluster_url_every_service() -> None:
    assert cluster_spec(up(redis_cluster=True), environ={}).redis_cluster
    assert not cluster_spec(up(), environ={}).redis_cluster
    at = replace(AT, redis_url="redis+cluster://:redis-password@127.0.0.1:7001,127.0.0.1:7002/0")
    spec = ClusterSpec(redis_cluster=True)
    services = service_settings(spec, at)
    assert {services.coordinator.redis_url, services.trainer.redis_url,
            *(p.redis_url for p in services.ps)} == {at.redis_url}
    for args, _env in commands(spec, at).values():
        assert "redis-password" not in " ".join(args)  # in the environment only, as for a server's URL


def test_the_credentials_file_gives_a_shell_the_cluster_s_settings_back_exactly(tmp_path: Path) -> None:
    """Values a shell would split or expand come back as they were; the file is 0600 from the start
    (also under umask 0) and an existing file is never overwritten."""
    import os
    import stat
    import subprocess

    from streamtrain.credentials import shell_exports, write_credentials

    hostile = replace(AT, job_token="a b'c\"$HOME`x`", admin_token="$(false);x")
    old = os.umask(0)
    try:
        path = write_credentials(tmp_path / "credentials.sh", shell_exports(hostile, "digits"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    names = ("STREAMTRAIN_COORDINATOR_URL", "STREAMTRAIN_REDIS_URL", "STREAMTRAIN_JOB_TOKEN",
             "STREAMTRAIN_ADMIN_TOKEN", "STREAMTRAIN_KAFKA_BOOTSTRAP", "STREAMTRAIN_JOB")
    script = f"source {path} && " + " && ".join(f'printf "%s\\0" "${n}"' for n in names)
    out = subprocess.run(["bash", "-c", script], env={"PATH": os.environ["PATH"]}, capture_output=True,
                         text=True, check=True).stdout
    assert out.split("\0")[:-1] == [hostile.coordinator_url, hostile.redis_url, hostile.job_token,
                                    hostile.admin_token, hostile.bootstrap, "digits"]
    with pytest.raises(FileExistsError):
        write_credentials(path, "")


def test_up_takes_the_tokens_and_redis_password_from_the_environment() -> None:
    from streamtrain.cluster import LocalCluster

    environ = {"STREAMTRAIN_JOB_TOKEN": "j-given", "STREAMTRAIN_ADMIN_TOKEN": "a-given",
               "STREAMTRAIN_REDIS_PASSWORD": "r-given"}
    spec = cluster_spec(UpSettings(), environ)
    cluster = LocalCluster(spec)
    assert (cluster.job_token, cluster.admin_token, spec.redis_password) == ("j-given", "a-given", "r-given")
    fresh = LocalCluster(cluster_spec(UpSettings(), {}))
    assert fresh.job_token and fresh.admin_token and fresh.job_token != "j-given"
    assert cluster_spec(UpSettings(), {}).redis_password == ""  # the launcher makes a random one
