"""Everything against a real Redis Cluster: the launcher, the URL, the parameter plane, the
coordinator and one end-to-end run whose accounting is exact.

A job's keys carry the hash tag ``{job}`` (``common.keys``), so each job lives in one slot
of the cluster; the tests keep apart by job name (a cluster has only database 0).
"""

from __future__ import annotations

import contextlib
import json
import socket
import uuid
from collections.abc import Iterator
from dataclasses import replace

import pytest
import redis as redis_lib
import torch
from plane_util import push_offsets_only, set_membership, small_model
from redis.cluster import RedisCluster as ClusterClient

from common.keys import JobKeys
from common.outage import redis_name
from common.redis_client import connect, connect_async, is_cluster_url, parse_cluster_url
from coordinator.client import CoordinatorClient
from coordinator.settings import CoordinatorSettings
from coordinator.testing import running_coordinator
from services import (
    FencedError,
    OptimizerConfig,
    ParameterServer,
    ParameterStore,
    Pusher,
    ServerSettings,
    unapplied_updates,
)
from services import connect as ps_connect
from streamtrain.accounting import audit
from streamtrain.cluster import LOCAL_STREAM, ClusterSpec, LocalCluster
from streamtrain.launcher import RedisCluster, pid_alive, redact_url, wait_until

pytestmark = pytest.mark.redis_cluster


def fresh_job() -> str:
    return f"cj-{uuid.uuid4().hex[:10]}"


def spread_job(client: ClusterClient, groups: int) -> str:
    """A fresh job name whose ``groups`` group slots sit on as many different masters."""
    for _ in range(200):
        job = fresh_job()
        if len({client.get_node_from_key(JobKeys(job).group(g).version).name for g in range(groups)}) == groups:
            return job
    raise AssertionError(f"no job name spread its groups over {groups} masters")


def apply_everything(redis_cluster: RedisCluster, client: ClusterClient, job: str, groups: int, *, what: str) -> None:
    """One server per group until every pushed update is applied, then stopped."""
    servers = [ParameterServer(ServerSettings(redis_url=redis_cluster.url, job=job, group=g, groups=groups,
                                              block_ms=50)) for g in range(groups)]
    try:
        for server in servers:
            server.start()
        wait_until(lambda: unapplied_updates(client, job) == 0, 60, what=what)
    finally:
        for server in servers:
            server.close()


@pytest.fixture
def client(redis_cluster: RedisCluster) -> Iterator[ClusterClient]:
    """A cluster client as the parameter plane makes it (``services.connect``)."""
    c = ps_connect(redis_cluster.url)
    try:
        yield c
    finally:
        c.close()


def job_keys(client: ClusterClient, job: str, pattern: str = "*") -> list[bytes]:
    """The job's keys matching ``pattern`` in its own slot and its groups' slots, from every master."""
    return sorted(client.keys(f"st:{{{job}*}}:{pattern}", target_nodes=ClusterClient.PRIMARIES))


# -- the launcher and the URL ----------------------------------------------------------------------
def test_launcher_starts_masters_and_replicas_and_stops_every_node() -> None:
    password = "p@ss:w/rd%40#x"  # URL-special characters survive the URL round trip
    cluster = RedisCluster(replicas=1, password=password, appendonly=True)
    squatter = socket.create_server(("127.0.0.1", cluster.nodes[2].bus_port))  # taken since it was picked
    try:
        cluster.start()
    finally:
        squatter.close()
    with cluster:
        assert len(cluster.nodes) == 6 and len(set(cluster.pids)) == 6
        roles = []
        for node in cluster.nodes:
            assert node.cluster_info()["cluster_state"] == "ok"
            direct = redis_lib.Redis(host=node.host, port=node.port, password=password)
            try:
                roles.append(direct.execute_command("ROLE")[0])
                assert direct.config_get("appendonly") == {"appendonly": "yes"}
            finally:
                direct.close()
            with open(f"/proc/{node.pid}/cmdline", "rb") as fh:
                assert password.encode() not in fh.read()
            assert (node.workdir / "redis.conf").stat().st_mode & 0o077 == 0
            assert password not in node.log_path.read_text()
        assert sorted(roles) == [b"master"] * 3 + [b"slave"] * 3
        assert password not in cluster.display_url and "***" in cluster.display_url
        c = connect(cluster.url)
        try:
            assert isinstance(c, ClusterClient)
            for i in range(50):  # keys spread over every master
                c.set(f"k{i}", i)
            assert {c.get(f"k{i}") for i in range(50)} == {str(i).encode() for i in range(50)}
            counts = [node.redis_connection.dbsize() for node in c.get_primaries()]
            assert len(counts) == 3 and all(n > 0 for n in counts) and sum(counts) == 50
        finally:
            c.close()
        pids = cluster.pids
    assert not any(pid_alive(p) for p in pids)


def test_launcher_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least 3 masters"):
        RedisCluster(masters=2)
    with pytest.raises(ValueError, match="replicas"):
        RedisCluster(replicas=-1)
    with pytest.raises(ValueError, match="printable ASCII") as err:
        RedisCluster(password="sec ret")
    assert "sec ret" not in str(err.value)


def test_the_cluster_url() -> None:
    url = "redis+cluster://:p%40ss@127.0.0.1:7000,127.0.0.1:7001,[::1]:7002"
    assert is_cluster_url(url) and is_cluster_url("REDIS+CLUSTER://h:1")
    assert not is_cluster_url("redis://127.0.0.1:6379/0")
    where = parse_cluster_url(url)
    assert where.nodes == (("127.0.0.1", 7000), ("127.0.0.1", 7001), ("::1", 7002))
    assert where.password == "p@ss" and where.username is None
    assert parse_cluster_url("redis+cluster://bob:pw@h:1/0").username == "bob"
    assert redact_url(url) == "redis+cluster://:***@127.0.0.1:7000,127.0.0.1:7001,[::1]:7002"
    for bad, why in [("redis+cluster://:secret@h:1/3", "only database 0"), ("redis+cluster://:secret@h", "host:port"),
                     ("redis+cluster://:secret@h:1?x=1", "no query"), ("redis+cluster://:secret@h:99999", "host:port")]:
        with pytest.raises(ValueError, match=why) as err:
            parse_cluster_url(bad)
        assert "secret" not in str(err.value)


def test_clients_name_the_cluster_never_its_password(redis_cluster: RedisCluster, client: ClusterClient) -> None:
    name = redis_name(client)
    assert name.startswith("Redis Cluster at 127.0.0.1:") and redis_cluster.password not in name
    assert isinstance(connect_async(redis_cluster.url), redis_lib.asyncio.cluster.RedisCluster)
    from common.outage import url_name

    named = url_name(redis_cluster.url)  # before a client exists, as the client names it (any order)
    assert named.startswith("Redis Cluster at ")
    assert set(named.split()[-1].split(",")) == set(name.split()[-1].split(","))
    assert url_name("redis://:secret@10.0.0.1:6390/3") == "Redis at 10.0.0.1:6390"


INCRBY = "return redis.call('INCRBY', KEYS[1], ARGV[1])"


def queue(pipe: object, job: str, sha: str) -> None:
    """The commands the planes send in MULTI/EXEC, on keys of ``job``'s slot (``sha``: :data:`INCRBY`'s)."""
    k = JobKeys(job).key
    pipe.set(k("s"), 1)
    pipe.hset(k("h"), mapping={"a": 1, "b": 2})
    pipe.hsetnx(k("h"), "a", 3)
    pipe.xadd(k("x"), {"d": b"\x00delta"}, id="5-0")
    pipe.get(k("s"))
    pipe.hgetall(k("h"))
    pipe.hkeys(k("h"))
    pipe.mget([k("s"), k("missing")])
    pipe.xrange(k("x"), min="1")
    pipe.exists(k("s"))
    pipe.evalsha(sha, 1, k("s"), 2)
    pipe.delete(k("s"), k("h"))


async def test_transactions_reply_as_on_one_server(redis: redis_lib.Redis, redis_url: str,
                                                   client: ClusterClient, redis_cluster: RedisCluster) -> None:
    """The same MULTI/EXEC (and plain pipeline) gives the same replies on the cluster as on one
    server, from redis-py and redis.asyncio clients (redis-py's own sync cluster transaction
    leaves the replies unparsed: ``common.redis_client`` parses them)."""
    replies = {}
    sha = client.script_load(INCRBY)  # on every master
    assert redis.script_load(INCRBY) == sha
    for name, c in (("server", redis), ("cluster", client)):
        for tx in (True, False):
            pipe = c.pipeline(transaction=tx)
            queue(pipe, fresh_job(), sha)
            replies[name, tx] = pipe.execute()
    for name, url in (("server", redis_url), ("cluster", redis_cluster.url)):
        c = connect_async(url)
        try:
            async with c.pipeline(transaction=True) as pipe:
                queue(pipe, fresh_job(), sha)
                replies[name, "async"] = await pipe.execute()
        finally:
            await c.aclose()
    assert replies["cluster", True] == replies["server", True]
    assert replies["cluster", False] == replies["server", False]
    assert replies["cluster", "async"] == replies["server", "async"]
    assert replies["cluster", True][8] == [(b"5-0", {b"d": b"\x00delta"})]


# -- the parameter plane ---------------------------------------------------------------------------
def test_push_apply_and_pull_on_the_cluster(redis_cluster: RedisCluster, client: ClusterClient) -> None:
    """init a model, push with fencing, apply with a real parameter server, pull: as on one server."""
    job = fresh_job()
    store = ParameterStore(client, job)
    store.init_model(small_model(), shard_elems=64, optimizer=OptimizerConfig(name="sgd", lr=0.5, momentum=0.0))
    assert store.pull().version == 0
    set_membership(client, job, {"a": [0]}, generation=1)
    pusher = Pusher(client, job, "a", codec="none")
    grads = {k: torch.ones_like(v) for k, v in small_model().items()}
    pusher.push(grads, generation=1, clock=1, offsets={0: (0, 10)}, samples=[("prod", 0, 10)], batch_size=10)
    with pytest.raises(FencedError):  # the fence inside the push script holds on a cluster too
        pusher.push(grads, generation=0, clock=2, offsets={0: (10, 20)})
    # scripts flushed (a node restarted): EVALSHA answers NOSCRIPT, the push reloads and retries
    client.script_flush()  # on every master
    pusher.push(grads, generation=1, clock=2, offsets={0: (10, 20)}, samples=[("prod", 10, 10)], batch_size=10)
    assert len(job_keys(client, job, "grad:*")) == 2 * len(store.layout.shards)

    server = ParameterServer(ServerSettings(redis_url=redis_cluster.url, job=job, block_ms=50))
    try:
        server.start()
        wait_until(lambda: unapplied_updates(client, job) == 0, 60, what="both updates applied")
    finally:
        server.close()
    snap = store.pull()
    for name, value in small_model().items():
        torch.testing.assert_close(snap.tensors[name], value - 2 * 0.5)  # two SGD steps of lr 0.5
    keys = JobKeys(job)
    assert client.hgetall(keys.offsets) == {b"0": b"20"}
    assert job_keys(client, job, "grad:*") == []  # applied and persisted: the blobs are gone
    assert snap.version >= 1  # one version per write: the server may apply both in one
    again = store.pull(since=snap)  # an incremental pull: nothing changed since
    assert again.version == snap.version and again.fetched == ()


def test_shard_groups_live_on_different_nodes_and_apply_there(redis_cluster: RedisCluster,
                                                                client: ClusterClient) -> None:
    """Three groups: each group's shards, deltas and gradient blobs sit in its own slot, the slots
    of the job and its groups spread over the masters, three servers apply in parallel, and a pull
    and the accounting equal applying the updates one by one."""
    # pick a job name whose three group slots are on three different masters
    job = spread_job(client, 3)
    keys = JobKeys(job)
    store = ParameterStore(client, job)
    meta = store.init_model(small_model(), shard_elems=64, optimizer=OptimizerConfig(name="sgd", lr=0.5, momentum=0.0),
                            groups=3)
    assert meta.groups == 3 and len(meta.layout.shards) >= 3
    for s in meta.layout.shards:  # each shard is stored on its group's node, nowhere else
        gk = keys.group(s.index % 3)
        assert client.exists(gk.shard(s.index)) == 1
        assert client.get_node_from_key(gk.shard(s.index)).name == client.get_node_from_key(gk.version).name
    set_membership(client, job, {"a": [0]}, generation=1)
    pusher = Pusher(client, job, "a", codec="none")
    grads = {k: torch.ones_like(v) for k, v in small_model().items()}
    for clock in (1, 2, 3):
        pusher.push(grads, generation=1, clock=clock, offsets={0: (10 * clock - 10, 10 * clock)},
                    samples=[("prod", 10 * clock - 10, 10)], batch_size=10)
    for g in range(3):  # a group's blobs are in its slot only
        blobs = client.keys(keys.group(g).key("grad", "*"), target_nodes=ClusterClient.PRIMARIES)
        assert len(blobs) == 3 * sum(1 for s in meta.layout.shards if s.index % 3 == g)
    apply_everything(redis_cluster, client, job, 3, what="three updates applied by every group")
    snap = store.pull()
    for name, value in small_model().items():
        torch.testing.assert_close(snap.tensors[name], value - 3 * 0.5)  # three SGD steps of lr 0.5
    assert len(snap.group_versions) == 3 and all(v >= 1 for v in snap.group_versions)
    assert client.xlen(keys.applied_samples) == 3
    assert job_keys(client, job, "grad:*") == [] and job_keys(client, job, "applied_by:*") == []


def test_a_table_spreads_over_the_nodes_and_servers(redis_cluster: RedisCluster, client: ClusterClient) -> None:
    """An embedding table of a three-group job: its rows sit in three slots on three masters, each
    row in the group its ID belongs to, applied there by three servers, and a pull of the batch's
    IDs reads them back (one round trip per group)."""
    import numpy as np

    from services.tables import RowGrads, TableSpec, group_of_ids
    from services.tables.store import pull_rows

    job = spread_job(client, 3)
    keys = JobKeys(job)
    table = TableSpec("user", 4)
    ParameterStore(client, job).init_model(small_model(), shard_elems=64, groups=3, tables=(table,))
    set_membership(client, job, {"a": [0]}, generation=1)
    pusher = Pusher(client, job, "a", codec="none")
    ids = np.arange(0, 3000, 7, dtype=np.int64)
    for clock in (1, 2):
        pusher.push(None, generation=1, clock=clock, offsets={0: (10 * clock - 10, 10 * clock)},
                    samples=[("prod", 10 * clock - 10, 10)], batch_size=10,
                    rows=[RowGrads("user", ids, np.ones((ids.size, 4), np.float32))])
    apply_everything(redis_cluster, client, job, 3, what="two updates applied by every group")
    sizes = []
    for g in range(3):
        rows = keys.group(g).table_rows("user")
        node = client.get_node_from_key(rows).name
        assert node == client.get_node_from_key(keys.group(g).version).name  # on the group's master
        held = np.array(sorted(int(np.frombuffer(k, "<i8")[0]) for k in client.hkeys(rows)), dtype=np.int64)
        assert (group_of_ids(held, 3) == g).all()
        sizes.append(held.size)
    assert sum(sizes) == ids.size and min(sizes) > ids.size // 5  # spread, none empty
    pulled = pull_rows(client, job, {"user": table}, 3, {"user": ids})
    assert pulled.tables["user"].present.all() and sorted(pulled.group_versions) == [0, 1, 2]
    # the feed: each group's changelog on its master, read there with the rows it names
    from services.tables.feed import read_changes
    assert all(client.get_node_from_key(keys.group(g).feed).name == client.get_node_from_key(keys.group(g).version).name
               for g in range(3))
    changes = read_changes(client, job, (table,), (0, 0, 0))
    assert sorted(changes.tables["user"].ids.tolist()) == ids.tolist() and not changes.more
    assert changes.tables["user"].values.tobytes() == pulled.tables["user"].values[
        np.searchsorted(ids, changes.tables["user"].ids)].tobytes()


def test_a_checkpoint_and_an_export_of_a_table_on_the_cluster(redis_cluster: RedisCluster, client: ClusterClient,
                                                               tmp_path) -> None:
    """A two-group job whose groups sit on two masters: its table is saved in pieces (each group's cut
    taken in its own slot), restored under another job name and exported, row for row."""
    import numpy as np
    import safetensors.numpy

    from services import restore_checkpoint, save_checkpoint
    from services.snapshot.table_export import export_tables
    from services.tables import RowGrads, TableSpec

    job = spread_job(client, 2)
    table = TableSpec("user", 4)
    ParameterStore(client, job).init_model(small_model(), shard_elems=64, groups=2, tables=(table,))
    set_membership(client, job, {"a": [0]}, generation=1)
    ids = np.arange(0, 700, 7, dtype=np.int64)
    Pusher(client, job, "a", codec="none").push(None, generation=1, clock=1, offsets={0: (0, 10)},
                                                samples=[("prod", 0, 10)], batch_size=10,
                                                rows=[RowGrads("user", ids, np.ones((ids.size, 4), np.float32))])
    apply_everything(redis_cluster, client, job, 2, what="the update applied by both groups")
    assert save_checkpoint(client, job, str(tmp_path / "c.pt"), rows_per_piece=16) == (1, 1)
    copy = f"{job}-copy"
    assert restore_checkpoint(client, str(tmp_path / "c.pt"), job=copy) == (1, 1)
    for g in range(2):
        assert client.hgetall(JobKeys(copy).group(g).table_rows("user")) == \
            client.hgetall(JobKeys(job).group(g).table_rows("user")) != {}
    assert job_keys(client, job, "table_cut") == job_keys(client, job, "shadow:*") == []
    done = export_tables(client, job, str(tmp_path / "tables"), rows_per_piece=16)
    assert done.rows == ids.size and done.pieces > 2
    listed = json.loads((tmp_path / "tables" / "manifest.json").read_text())["tables"][0]["pieces"]
    got = np.concatenate([safetensors.numpy.load_file(str(tmp_path / "tables" / p["file"]))["ids"] for p in listed])
    assert sorted(got.tolist()) == ids.tolist()


# -- the coordinator -------------------------------------------------------------------------------
async def test_coordinator_registers_heartbeats_and_fences_on_the_cluster(
        redis_cluster: RedisCluster, client: ClusterClient, silent_broker: str) -> None:
    job = fresh_job()
    settings = CoordinatorSettings(job=job, redis_url=redis_cluster.url, kafka_bootstrap=silent_broker,
                                   topic="train", partitions=4, lease_ms=30_000, heartbeat_interval_ms=1000,
                                   admin_token="admin-secret", job_token="job-secret", kafka_timeout_ms=200,
                                   table_consistency="asp")
    async with running_coordinator(settings) as http:
        # the job's first start writes the fields a restart leaves alone (a WATCH/MULTI on the cluster)
        assert client.hget(JobKeys(job).config, "table_consistency") == b"asp"
        a = CoordinatorClient(str(http.make_url("")), "job-secret", session=http.session)
        reg = await a.register({"device": "cpu", "threads": 1})
        assert list(reg.partitions) == [0, 1, 2, 3]
        push_offsets_only(client, job, reg.member_id, reg.generation, list(reg.partitions), clock=1)  # fenced push
        b = CoordinatorClient(str(http.make_url("")), "job-secret", session=http.session)
        await b.register({"device": "cpu", "threads": 1})  # a compare-and-set (WATCH/MULTI) on the cluster
        now = await a.heartbeat({"clock": 1})
        assert now.generation == reg.generation + 1 and len(now.partitions) == 2
        with pytest.raises(FencedError, match="is stale"):
            push_offsets_only(client, job, reg.member_id, reg.generation, list(reg.partitions), clock=2)
        resp = await http.get("/v1/status", headers={"Authorization": "Bearer admin-secret"})
        status = await resp.json()
        assert resp.status == 200 and len(status["members"]) == 2
        resp = await http.get("/readyz")  # Kafka is down here; Redis (the cluster) answers PING
        assert (await resp.json())["checks"]["redis"] == "ok"
        await a.leave()
        await b.leave()
    assert client.hlen(JobKeys(job).members) == 0


# -- end to end ------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_cluster_on_a_redis_cluster_accounts_exactly(tmp_path) -> None:
    spec = ClusterSpec(redis_cluster=True, trainers=2,
                       coordinator=CoordinatorSettings(partitions=2, codec="topk+fp16"),
                       producer=replace(LOCAL_STREAM, source="digits?repeat=2", limit=2000))
    cluster = LocalCluster(spec, workdir=tmp_path / "cluster")
    try:
        cluster.start()
        assert is_cluster_url(cluster.redis_url)
        with pytest.raises(ValueError, match="Redis Cluster"):
            cluster.restart("redis")
        cluster.wait_consumed(timeout_s=180)
        cluster.quiesce()
        report = audit(cluster.bootstrap, spec.topic, cluster.redis_url, spec.job)
        assert report.exact, report
        assert report.uncommitted == 0 and report.rejected_updates == 0
        assert report.applied == report.expected == 2000
        with contextlib.closing(connect(cluster.redis_url)) as c:
            assert ParameterStore(c, spec.job).version() > 0
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_services_started_while_the_whole_cluster_is_down_wait_for_it(tmp_path) -> None:
    """A coordinator and a parameter server started before any node of the cluster runs log that
    Redis is unreachable and wait (as for a single server, up to their outage limit) instead of
    failing; once the cluster is up they come up: the coordinator stores the job's configuration
    and the server loads the model and applies a push."""
    from streamtrain.launcher import ServiceProcess, free_port

    cluster = RedisCluster(workdir=tmp_path / "redis")  # its ports and password are picked; nothing runs
    job, ps_job = fresh_job(), fresh_job()  # the test plays the trainers of the server's job
    env = {"STREAMTRAIN_REDIS_URL": cluster.url, "STREAMTRAIN_JOB_TOKEN": "jt", "STREAMTRAIN_ADMIN_TOKEN": "at",
           "STREAMTRAIN_OUTAGE_LIMIT_S": "120"}
    port = free_port()
    procs = [ServiceProcess("coordinator", ["coordinator", "--job", job, "--port", str(port), "--partitions", "1",
                                            "--kafka-bootstrap", f"127.0.0.1:{free_port()}",
                                            "--kafka-timeout-ms", "200"], env=env, workdir=tmp_path / "coordinator"),
             ServiceProcess("ps", ["ps", "--job", ps_job, "--block-ms", "50", "--start-timeout-s", "120"], env=env,
                            workdir=tmp_path / "ps")]
    try:
        for proc in procs:
            proc.start()
        for proc in procs:  # the same line as for a server that does not answer
            wait_until(lambda p=proc: "unreachable" in p.log_tail(20) and "waiting up to 120 s" in p.log_tail(20),
                       90, what=f"{proc.name} to say it waits for Redis")
        assert "Redis Cluster at " in procs[1].log_tail(20) and "RedisClusterException" not in procs[1].log_tail(40)
        cluster.start()
        client = connect(cluster.url)
        try:
            wait_until(lambda: client.exists(JobKeys(job).config) == 1, 60, what="the coordinator's job config")
            store = ParameterStore(client, ps_job)
            store.init_model(small_model(), shard_elems=64, optimizer=OptimizerConfig(name="sgd", lr=0.5, momentum=0.0))
            set_membership(client, ps_job, {"a": [0]}, generation=1)
            grads = {k: torch.ones_like(v) for k, v in small_model().items()}
            Pusher(client, ps_job, "a", codec="none").push(grads, generation=1, clock=1, offsets={0: (0, 10)})
            wait_until(lambda: unapplied_updates(client, ps_job) == 0, 90, what="the push applied by the waiting ps")
        finally:
            client.close()
        for proc in procs:
            assert proc.returncode is None, proc.log_tail(40)
            assert "reachable again after" in proc.log_tail(200), proc.log_tail(40)
    finally:
        for proc in procs:
            proc.stop()
        cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_job_rides_out_a_failover_of_its_master_and_accounts_exactly(tmp_path) -> None:
    """Three masters with a replica each; during training the master holding the job's slot is
    SIGKILLed. Its replica is promoted, the coordinator, the parameter server and the trainers carry
    on by themselves, and the record-by-record audit is exact afterwards."""
    spec = ClusterSpec(redis_cluster=True, redis_replicas=1, trainers=2,
                       coordinator=CoordinatorSettings(partitions=2, codec="topk+fp16"),
                       producer=replace(LOCAL_STREAM, source="digits?repeat=4", limit=5000, rate=250.0))
    cluster = LocalCluster(spec, workdir=tmp_path / "cluster")
    try:
        cluster.start()
        nodes = cluster.redis
        assert isinstance(nodes, RedisCluster)
        key = JobKeys(spec.job).config
        cluster.wait_for(lambda st: sum(p["committed"] or 0 for p in st["partitions"]) >= 20, timeout_s=120,
                         what="training under way")
        killed = cluster.kill_redis_master()
        wait_until(lambda: nodes.master_of(key).address != killed, 60, what="the replica promoted")
        st = cluster.wait_consumed(timeout_s=240)  # raises if a service died meanwhile
        assert len(st["members"]) == 2
        cluster.quiesce()
        report = audit(cluster.bootstrap, spec.topic, cluster.redis_url, spec.job)
        assert report.exact, report
        assert report.uncommitted == 0 and report.rejected_updates == 0
        assert report.applied == report.expected == 5000
        for proc in [cluster.coordinator, *cluster.ps]:
            assert proc is not None and proc.returncode is None
            # it felt the failover: it logged the killed master unreachable. redis-py 8.2's asyncio cluster
            # client may ride the whole failover out inside one command (retries, a topology refresh),
            # so the coordinator's lease checker need not see an outage; its sampler logs the dead node
            log = proc.log_path.read_text()
            assert any("unreachable" in line and f"connecting to {killed}" in line for line in log.splitlines()), \
                proc.log_tail(40)
    finally:
        cluster.stop()
