"""Berth's FastAPI app inside Airflow's API server: the REST API (`routes.py`, shapes in
`models.py`, who may do what in `access.py`) and the Prometheus metrics (`metrics.py`), all
read from the store (`source.py`). `plugins/berth_plugin.py` registers it with Airflow."""
