"""The commands: submit, sweep, jobs, summary, export (each also `python -m orchestrator.NAME`)."""
