"""Datasets for the jobs: `[data]` (DataConfig), a resumable torchdata record stream over local JSONL / Parquet
files (RecordStream), and the RL job's task feed (TaskFeed)."""

from app.data.config import DataConfig
from app.data.errors import DataError, DataExhausted
from app.data.stream import RecordStream
from app.data.tasks import TaskFeed, build_task_feed

__all__ = ["DataConfig", "DataError", "DataExhausted", "RecordStream", "TaskFeed", "build_task_feed"]
