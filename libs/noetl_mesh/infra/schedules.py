"""The NATS side of schedules (D31): the stream that holds the schedule messages and their firings, and
the KV bucket of their definitions. Created by ``setup`` as the admin (:func:`ensure`); the scheduler
only uses them.

``NOETL_SCHEDULES``: subjects ``noetl.schedule.def.<id>`` (one schedule message per schedule, header
``Nats-Schedule``) and ``noetl.schedule.fire.<id>`` (the server's firings); ``allow_msg_schedules``
makes the server fire them, ``allow_msg_ttl`` lets a firing carry a TTL; work-queue retention removes a
firing once the scheduler acknowledged it (the schedule messages have no consumer, so they stay); no
max age, which would drop the schedule messages themselves. ``noetl_schedules``: KV, one record per
schedule (core/schedules.py ``definition``), history 1.
"""
from __future__ import annotations

import logging

from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from ..core.schedules import BUCKET, STREAM, SUBJECTS

log = logging.getLogger("noetl.schedules")
UNSUPPORTED = (f"the NATS server does not keep message schedules in {STREAM} (allow_msg_schedules): schedules "
               "need nats-server 2.14 or later (cron time zones); nothing would fire")


def stream_config(replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=STREAM, subjects=list(SUBJECTS), storage=StorageType.FILE, retention=RetentionPolicy.WORK_QUEUE,
        allow_msg_schedules=True, allow_msg_ttl=True, duplicate_window=120, num_replicas=replicas,
        description="noetl schedules: schedule messages (def) and their firings (fire)")


async def ensure(js, replicas: int = 1) -> None:
    """Create the schedules stream and bucket when missing (idempotent). A server too old for message
    schedules ignores the setting: that is logged (the scheduler refuses new schedules then), and the
    rest of the stack works."""
    try:
        info = await js.stream_info(STREAM)
    except NotFoundError:
        info = await js.add_stream(stream_config(replicas))
    if not supported(info.config):
        log.error("setup: %s", UNSUPPORTED)
    try:
        await js.key_value(BUCKET)
    except BucketNotFoundError:
        await js.create_key_value(KeyValueConfig(bucket=BUCKET, history=1, storage=StorageType.FILE,
                                                 replicas=replicas, description="noetl schedule definitions"))


def supported(config: StreamConfig) -> bool:
    """Whether the server keeps the schedules stream's schedules (an older one drops the setting)."""
    return bool(config.allow_msg_schedules)
