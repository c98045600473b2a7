"""What the driver does with a job: pre-flight, the MLflow run, Ray, the trainer, and the worker adapter."""
