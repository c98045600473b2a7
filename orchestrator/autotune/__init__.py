"""Precision autotune: `ampflow tune JOB --output FILE` finds the cheapest per-layer policy that keeps the model's
numbers, and writes it as a job with `precision.rules`.

    probe     each layer with parameters, lowered alone to each candidate dtype on a few of the job's batches:
              its output and gradient error against fp32, its fp16 headroom, its FLOPs and bytes, its cost
    costs     a layer's cost: measured on the device at hand, or from a target device's rates (`devices`)
    search    the cheapest assignment whose predicted error stays within `tune.tolerance` (plain functions)
    check     the chosen policy trained beside fp32 from the same seed; the riskiest layer goes up a dtype
              until the loss curves agree
    command   the command line, the console and the tune's MLflow run

The package uses the training core (`orchestrator.train`) and `orchestrator.precision`; they never import it.
"""
