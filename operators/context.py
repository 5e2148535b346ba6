"""Where the operators and triggers find Berth: `berth.settings` (environment variables,
read when a task or trigger runs, never when a DAG file is parsed). Re-exported here so that
Airflow code has one import for it."""

from berth.settings import REPO_ROOT, BerthSettings, settings

__all__ = ["REPO_ROOT", "BerthSettings", "settings"]
