"""Datasets for the jobs: `[data]` (DataConfig), a resumable torchdata record stream over local JSONL / Parquet
files (RecordStream), step-sized batches of it (RecordFeed), the RL job's task feed (TaskFeed) and the offline
job's trajectory feed."""

from app.data.config import DataConfig
from app.data.errors import DataExhausted
from app.data.feed import RecordFeed
from app.data.stream import RecordStream
from app.data.tasks import TaskFeed, build_task_feed
from app.data.trajectories import PathLimit, build_trajectory_feed, path_limits

__all__ = ["DataConfig", "DataExhausted", "PathLimit", "RecordFeed", "RecordStream", "TaskFeed",
           "build_task_feed", "build_trajectory_feed", "path_limits"]
