"""Performance harnesses: `python -m bench.NAME [--smoke] [--json PATH]` from the repository root.

Each harness measures its candidates side by side in one run and prints `ratio <name> = <value>`
lines; results and how to read them are in docs/benchmarks.md.
"""
