"""MLflow tracking of jobs and attempts (see tracker.py); imports mlflow, never Airflow."""

from berth.tracking.tracker import STATUS, AttemptRun, JobTracker, TrackingError

__all__ = ["STATUS", "AttemptRun", "JobTracker", "TrackingError"]
