"""MLflow: the run (`tracker`), the driver's one writer, the report relay, the console, plots, secrets."""
