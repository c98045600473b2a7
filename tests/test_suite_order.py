"""`make test` hands the test files out longest first (tests/suite_order.py), and says which files took longest."""

import re

from conftest import REPO
from suite_order import FILE_SECONDS, file_order, slowest_files


def test_listed_files_go_longest_first_then_unlisted_slow_ones_then_the_rest_by_number_of_tests():
    longest, second = sorted(FILE_SECONDS, key=FILE_SECONDS.get, reverse=True)[:2]
    collected = [("tests/test_quick.py", False)] * 5 + [("tests/test_one_slow.py", True), ("tests/test_one_slow.py", False)] \
        + [("tests/test_few.py", False)] * 2 + [(f"tests/{second}", True)] + [(f"tests/{longest}", True)] * 2 \
        + [("tests/test_also_slow.py", True)] * 3 + [("tests/test_tied.py", False)] * 2
    assert file_order(collected) == [f"tests/{longest}", f"tests/{second}", "tests/test_also_slow.py",
                                     "tests/test_one_slow.py", "tests/test_quick.py", "tests/test_few.py",
                                     "tests/test_tied.py"]


def test_a_listed_file_without_its_slow_tests_is_ordered_as_an_unlisted_one():
    """`make test-fast` leaves the slow tests out: a long file's figure then says nothing of what is left of it."""
    listed = next(iter(FILE_SECONDS))
    collected = [("tests/test_quick.py", False)] * 3 + [(f"tests/{listed}", False)] * 2 \
        + [("tests/test_many.py", False)] * 4
    assert file_order(collected) == ["tests/test_many.py", "tests/test_quick.py", f"tests/{listed}"]


def test_every_listed_file_is_a_test_file_of_the_suite():
    """A file renamed or removed leaves a stale entry: its figure then orders nothing."""
    missing = [name for name in FILE_SECONDS if not (REPO / "tests" / name).is_file()]
    assert not missing, f"tests/suite_order.py lists files the suite no longer has: {missing}"


def test_make_test_keeps_the_collection_order_when_it_hands_out_files():
    """xdist's loadscope reorders files by their number of tests unless told not to."""
    args = re.search(r"^PYTEST_ARGS \?= (.*)$", (REPO / "Makefile").read_text(), re.MULTILINE).group(1).split()
    assert "--no-loadscope-reorder" in args and args[args.index("--dist") + 1] == "loadscope"


def test_the_slowest_files_sum_every_phase_of_their_tests_and_say_whether_they_are_listed():
    listed = next(iter(FILE_SECONDS))
    durations = [(f"tests/{listed}::test_a", 1.0), (f"tests/{listed}::test_a", 30.0), (f"tests/{listed}::test_b", 9.5),
                 ("tests/test_new.py::test_c[x]", 50.0), ("tests/test_new.py::test_c[y]", 1.0),
                 ("tests/test_tiny.py::test_d", 0.1)]
    lines = slowest_files(durations, count=2)
    assert len(lines) == 2
    assert re.fullmatch(r"\s*51\.0s tests/test_new\.py  \(not listed\)", lines[0])
    assert re.fullmatch(rf"\s*40\.5s tests/{re.escape(listed)}  \(listed at {FILE_SECONDS[listed]} s\)", lines[1])
