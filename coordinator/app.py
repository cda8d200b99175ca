"""The coordinator's aiohttp application: its routes and its lifecycle.

:func:`create_app` builds the application from the handlers; its ``cleanup_ctx`` connects Redis, writes
the job configuration if absent, renews every stored lease (a restarted coordinator does not kill
trainers that could not reach it), starts the lease checker, the Kafka probe and the history sampler,
and closes them all on shutdown. Shared state and the lease checker: :mod:`coordinator.runtime`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from common.outage import REDIS_DOWN, Outage
from common.redis_client import connect_async
from common.tasks import cancel_and_wait

from .channel import channel, close_channels
from .feed_route import setup_feed_routes
from .join_route import setup_join_route
from .kafka_probe import KafkaProbe
from .membership import RenewLeases
from .metrics import Metrics
from .model_route import setup_model_route
from .routes import error_middleware, setup_routes
from .runtime import LEASE_CHECKER, RUNTIME, SAMPLER, SETTINGS, Runtime, apply_event, lease_checker, now_ms
from .sampler import Sampler
from .serving_route import setup_serving_route
from .settings import CoordinatorSettings
from .state import JobConfig, Store

logger = logging.getLogger(__name__)

__all__ = ["create_app", "initial_config"]


def initial_config(settings: CoordinatorSettings) -> JobConfig:
    """The job configuration a fresh job starts with."""
    return JobConfig(consistency=settings.consistency, staleness=settings.staleness,
                     codec=settings.codec, optimizer=settings.optimizer, lr=settings.lr,
                     topic=settings.topic, partitions=settings.partitions,
                     ps_groups=settings.ps_groups, table_consistency=settings.table_consistency,
                     table_staleness=settings.table_staleness, local_steps=settings.local_steps,
                     outer_lr=settings.outer_lr, outer_momentum=settings.outer_momentum, paused=False)


async def _runtime_ctx(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    redis = connect_async(settings.redis_url)  # a server or a redis+cluster:// Redis Cluster
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="coordinator-kafka")
    probe = KafkaProbe(settings.kafka_bootstrap, settings.kafka_timeout_ms)
    try:
        store = Store(redis, settings.job, settings.departed_retention_s)
        outage = Outage(f"Redis of job {settings.job}", settings.outage_limit_s, logger)
        while True:  # a coordinator that starts while Redis is away waits for it (up to the limit)
            try:
                config = await store.ensure_config(initial_config(settings))
                break
            except REDIS_DOWN as exc:
                await asyncio.sleep(outage.failed(exc))
        outage.recovered()
        if config.ps_groups != settings.ps_groups:
            logger.warning("job %s keeps ps_groups=%d (fixed when the job began); --ps-groups %d "
                           "is ignored", settings.job, config.ps_groups, settings.ps_groups)
        rt = Runtime(settings=settings, redis=redis, store=store, metrics=Metrics(), probe=probe,
                     executor=executor)
        state, _ = await apply_event(rt, RenewLeases(now_ms=now_ms(), lease_ms=settings.lease_ms))
        logger.info("coordinator of job %s up: generation=%d members=%d partitions=%d "
                    "consistency=%s (s=%d) tables=%s (s=%d) ps_groups=%d", settings.job, state.generation,
                    len(state.members), config.partitions, config.consistency, config.staleness,
                    *config.table_bound(), config.ps_groups)
        app[RUNTIME] = rt
        app[LEASE_CHECKER] = asyncio.create_task(lease_checker(rt), name="lease-checker")
        app[SAMPLER] = Sampler(settings, rt.metrics)
        app[SAMPLER].start(store)
        yield
    finally:
        if SAMPLER in app:
            await app[SAMPLER].close()
        await cancel_and_wait(app.get(LEASE_CHECKER))
        await redis.aclose()
        await asyncio.get_running_loop().run_in_executor(executor, probe.close)
        executor.shutdown(wait=True)


def create_app(settings: CoordinatorSettings) -> web.Application:
    """The coordinator application for ``settings``.

    Raises:
        ValueError: the admin or job token is empty.
    """
    if not settings.admin_token or not settings.job_token:
        raise ValueError("the coordinator needs both --admin-token (STREAMTRAIN_ADMIN_TOKEN) and "
                         "--job-token (STREAMTRAIN_JOB_TOKEN)")
    app = web.Application(client_max_size=settings.max_request_bytes,
                          middlewares=[error_middleware])
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_runtime_ctx)
    setup_routes(app)
    setup_model_route(app)  # GET /v1/model (imports the parameter plane and torch on first use only)
    setup_feed_routes(app)  # GET /v1/model/updates and /v1/embeddings/{table} (likewise)
    setup_serving_route(app)  # POST /v1/serving/replicas/{name}: the serving replicas' reports (in memory)
    setup_join_route(app)  # POST /v1/join/joiners/{name}: the joiners' reports (in memory)
    app.router.add_get("/v1/members/{member_id}/channel", channel)
    app.on_shutdown.append(close_channels)
    return app
