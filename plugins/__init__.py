"""Airflow plugins of Berth: what Airflow's API server shows of the queue, quotas and GPUs.

Airflow imports every `.py` file under its plugins folder as a top-level module named after
the file, so a `models.py` here would become `sys.modules["models"]` for the whole process.
`.airflowignore` therefore leaves Airflow only `berth_plugin.py`, the registration, which
imports the rest as the package `plugins` (the repository root is on the path, as for `dags`
and `operators`).
"""
