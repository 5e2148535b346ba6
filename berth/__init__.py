"""Berth, the platform around the engine: the job spec users write, settings, the SQL store,
the runtimes (local, Kubernetes), data staging, MLflow tracking and the `berth` command line.

The engine itself (`scheduling/`) is pure decisions over immutable snapshots; everything that
touches a database, a process, a cluster or a server lives here. Airflow is never imported:
that side is `operators/`, `plugins/` and `dags/`.
"""
