"""The batches room's app keys: the objects the app's start-up builds once per process."""

from __future__ import annotations

from aiohttp import web

from gateway.batches.files import Files
from gateway.batches.records import BatchRecords
from gateway.batches.runner import BatchRunner

FILES = web.AppKey[Files]("files")
BATCH_RECORDS = web.AppKey[BatchRecords]("batch_records")
BATCH_RUNNER = web.AppKey[BatchRunner]("batch_runner")
