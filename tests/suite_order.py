"""The order in which `make test` hands the test files to its test processes: the longest first.

`--dist loadscope` gives each test process whole files, one after another, in the order they are collected
(`--no-loadscope-reorder`: xdist's own order, by number of tests, would put a file of 45 quick checks before a
file of one three-minute end-to-end test). Longest first, the files that take minutes start at once, side by side,
and the short ones fill in the ends: the suite's wall time is then close to its total over the test processes,
instead of one long file started late running on alone at the end.

`FILE_SECONDS` is what each long file took in a full `make test`; `make test` prints the slowest files after each
run (`slowest_files`) to keep it up to date. A file not listed goes after the listed ones: first those with tests
marked `slow`, then the rest, each group by its number of tests.
"""

from collections import Counter
from collections.abc import Iterable
from pathlib import Path

FILE_SECONDS = {
    "test_interrupt_e2e.py": 290,
    "test_bench.py": 285,
    "test_sweep.py": 215,
    "test_hostile_secrets.py": 210,
    "test_elastic_e2e.py": 195,
    "test_resume_e2e.py": 175,
    "test_gpu_visit.py": 165,
    "test_remote_submit.py": 160,
    "test_submit_e2e.py": 150,
    "test_third_party_e2e.py": 150,
    "test_lm.py": 150,
    "test_s3_e2e.py": 145,
    "test_local_ray.py": 145,
    "test_tracking_outage_e2e.py": 145,
    "test_guardrails_e2e.py": 130,
    "test_logged_model_e2e.py": 130,
    "test_tracking_refused_e2e.py": 110,
    "test_hostile_predict.py": 100,
    "test_cluster_e2e.py": 100,
    "test_elastic.py": 100,
    "test_watchdog.py": 95,
    "test_fsdp_e2e.py": 95,
    "test_own_code_e2e.py": 95,
    "test_watchdog_e2e.py": 95,
    "test_transformers_precision.py": 90,
    "test_one_core.py": 90,
    "test_export_untrusted.py": 90,
    "test_precision_e2e.py": 90,
    "test_fsdp_loop.py": 60,
    "test_preemption_e2e.py": 55,
    "test_k8s_mlflow_server.py": 55,
    "test_loader_failures.py": 50,
}
"""Seconds each long test file took in a full `make test` (2 cores, 3 test processes), rounded: only their
order matters. The files that take longest come first."""

SHOWN_FILES = 15
"""How many of the slowest files `make test` prints after its run."""


def file_order(files: Iterable[tuple[str, bool]]) -> list[str]:
    """The test files (their paths) in the order to run them, from one `(path, is slow)` pair per collected test:
    the listed files by their seconds, longest first, then the unlisted ones with slow tests, then the rest, each
    of these two by number of tests, most first. Ties keep the order of collection. A listed file none of whose
    slow tests were collected (`make test-fast`) counts as unlisted."""
    tests, slow, first_seen = Counter(), set(), {}
    for path, is_slow in files:
        first_seen.setdefault(path, len(first_seen))
        tests[path] += 1
        if is_slow:
            slow.add(path)

    def key(path: str):
        seconds = FILE_SECONDS.get(Path(path).name)
        if seconds is not None and path in slow:  # its figure is for its slow tests; `-m "not slow"` leaves them out
            return 0, -seconds, first_seen[path]
        return 1 if path in slow else 2, -tests[path], first_seen[path]

    return sorted(first_seen, key=key)


def slowest_files(durations: Iterable[tuple[str, float]], count: int = SHOWN_FILES) -> list[str]:
    """Lines for the run's summary: the `count` files whose tests took longest, from `(nodeid, seconds)` of each
    test's phases, each with its figure in `FILE_SECONDS` (or that it is not listed)."""
    totals = Counter()
    for nodeid, seconds in durations:
        totals[nodeid.split("::", 1)[0]] += seconds
    lines = []
    for path, seconds in totals.most_common(count):
        listed = FILE_SECONDS.get(Path(path).name)
        lines.append(f"{seconds:8.1f}s {path}  ({'listed at %d s' % listed if listed is not None else 'not listed'})")
    return lines
