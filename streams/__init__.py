"""The job's stream processors: the retry scheduler and the completion ledger (``batchline streams JOB``)."""

from streams.app import StreamsApp, StreamsReport
from streams.ledger import Ledger
from streams.retry_scheduler import RetryScheduler
from streams.tally import compute_run_stats

__all__ = ["Ledger", "RetryScheduler", "StreamsApp", "StreamsReport", "compute_run_stats"]
