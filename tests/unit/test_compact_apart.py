"""`serve` compacts its kept log in a process of its own (stream.kafka.log_cleaner.compact_apart):
the same plans, files and remembered lengths as ``compact`` in the process, its damage and
its log lines reach the caller, and the caller's memory does not carry its transient (a
compaction in `serve` left the RSS higher each time: ~400 MiB an hour in the soak)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stream.kafka.embedded_log import CorruptLog, EmbeddedLog, LogRecord, encode_frame
from stream.kafka.log_cleaner import Retention, compact, compact_apart
from stream.state.store import APPLIED_KEY, admit_changelog, applied_at, encode_applied
from tests.polling import eventually

CLUSTER = "mmcache-embedded-tansu-0123456789abcdef"


def _kept_log(root: Path, changelog: list[LogRecord], events: list[LogRecord], partitions: int = 2) -> EmbeddedLog:
    files = EmbeddedLog(root)
    files.create(CLUSTER)
    files.record_topics({"app-events": (partitions, {}), "app-dead-letters": (partitions, {})})
    files.record_topics({"app-changelog": (partitions, {})}, changelogs={"app-changelog": "app-events"})
    for partition in range(partitions):
        files.partition_path("app-changelog", partition).write_bytes(b"".join(map(encode_frame, changelog)))
        files.partition_path("app-events", partition).write_bytes(b"".join(map(encode_frame, events)))
        files.partition_path("app-dead-letters", partition).write_bytes(b"".join(map(encode_frame, events[:2])))
    return files


def _log(events: int, keys: int) -> tuple[list[LogRecord], list[LogRecord]]:
    """A changelog overwriting ``keys`` keys, its applied offsets, and the events."""
    changelog = []
    for offset in range(events):
        key = b"k%d" % (offset % keys)
        changelog.append(LogRecord(2 * offset, 1, 0, key, b"v%d" % offset if offset % 7 else None))
        changelog.append(LogRecord(2 * offset + 1, 1, 0, APPLIED_KEY, encode_applied(offset)))
    events_ = [LogRecord(offset, 1_700_000_000_000 + offset, 0, b"ns/e", b"event %d" % offset)
               for offset in range(events + 3)]  # three not applied yet
    return changelog, events_


def _everything(files: EmbeddedLog) -> dict[str, bytes]:
    return {str(path.relative_to(files.root)): path.read_bytes() for path in sorted(files.root.glob("*/*.log"))}


def test_the_child_compacts_as_the_process_would(tmp_path):
    changelog, events = _log(200, 9)
    here, apart = (_kept_log(tmp_path / name, changelog, events) for name in ("here", "apart"))
    retention = Retention(ms=-1, bytes=2_000)
    tombstones = {0: 50, 1: 2**62}.__getitem__
    planned = compact(here, applied_at, admit_changelog, tombstones, retention, 10**15)
    planned_apart = compact_apart(apart, applied_at, admit_changelog, tombstones, retention, 10**15)
    assert planned_apart == planned and planned[("app-events", 0)]
    assert _everything(apart) == _everything(here) != {}
    assert apart.remembered() == here.remembered() != {}


def test_the_childs_log_lines_are_logged_by_the_caller(tmp_path, caplog):
    changelog, events = _log(50, 3)
    files = _kept_log(tmp_path, changelog, events)
    with caplog.at_level(logging.INFO, logger="stream.kafka.log_cleaner"):
        compact_apart(files, applied_at, admit_changelog, lambda partition: 2**62, Retention(-1, -1), 10**15)
    assert any("compacted" in record.getMessage() and "dropped" in record.getMessage()
               for record in caplog.records if record.name == "stream.kafka.log_cleaner"), caplog.text


def test_damage_found_by_the_child_is_raised_to_the_caller_with_its_fields(tmp_path):
    changelog, events = _log(20, 3)
    files = _kept_log(tmp_path, changelog, events)
    path = files.partition_path("app-changelog", 1)
    damaged = bytearray(path.read_bytes())
    damaged[len(encode_frame(changelog[0])) + 20] ^= 0xFF
    path.write_bytes(bytes(damaged))
    before = _everything(files)
    with pytest.raises(CorruptLog, match="nothing was changed") as raised:
        compact_apart(files, applied_at, admit_changelog, lambda partition: 2**62, Retention(-1, 1), 10**15)
    assert raised.value.path == path and raised.value.at == len(encode_frame(changelog[0]))
    assert _everything(files) == before


_BUILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path[:0] = [{tests!r}, {root!r}]
    from test_compact_apart import _kept_log, _log
    _kept_log(Path({path!r}), *_log(150_000, 1_000), partitions=2)
""")

# The peak is VmHWM, this process's own: ru_maxrss would start at the forking parent's
# (a pytest worker's) peak, carried over the exec.
_PEAK = textwrap.dedent("""
    import re, sys
    from pathlib import Path
    sys.path[:0] = [{root!r}]
    from stream.kafka import log_cleaner
    from stream.kafka.embedded_log import EmbeddedLog
    from stream.state.store import admit_changelog, applied_at
    def peak_kib():
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1))
    files = EmbeddedLog(Path({path!r}))
    before = peak_kib()
    plans = getattr(log_cleaner, {how!r})(files, applied_at, admit_changelog, lambda p: 2**62,
                                          log_cleaner.Retention(-1, -1), 10**15)
    print((peak_kib() - before) // 1024)
""")


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _peak_growth_mib(tmp_path: Path, how: str) -> int:
    """The peak RSS a process adds compacting a log another process wrote."""
    tests, root, path = str(Path(__file__).parent), str(Path(__file__).parents[2]), str(tmp_path / how)
    _run(_BUILD.format(tests=tests, root=root, path=path))
    return int(_run(_PEAK.format(root=root, path=path, how=how)).split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_the_callers_peak_memory_does_not_carry_the_compaction(tmp_path):
    """600,000 changelog records and 300,000 events: compacted in the process, its peak
    RSS rises by the scanned frames (the finding); apart, by the plans it gets back only."""
    in_process, apart = _peak_growth_mib(tmp_path, "compact"), _peak_growth_mib(tmp_path, "compact_apart")
    print(f"peak RSS growth: compact {in_process} MiB, compact_apart {apart} MiB")
    assert in_process >= 100, in_process
    assert apart <= in_process / 4, (apart, in_process)


def _stall(frames):
    """An ``admit`` that never returns: the child is mid-compaction for as long as needed."""
    while True:
        time.sleep(60)


_KILLED = textwrap.dedent("""
    import sys
    from pathlib import Path
    sys.path[:0] = [{tests!r}, {root!r}]
    from test_compact_apart import _kept_log, _log, _stall
    from stream.kafka.log_cleaner import Retention, compact_apart
    from stream.state.store import applied_at
    files = _kept_log(Path({path!r}), *_log(10, 2))
    print("compacting", flush=True)
    compact_apart(files, applied_at, _stall, lambda p: 2**62, Retention(-1, -1), 10**15)
""")


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent's death signal is Linux's")
def test_a_child_left_by_a_killed_serve_ends_at_once(tmp_path):
    """Else it would go on rewriting files that the next `serve` compacts too."""
    code = _KILLED.format(tests=str(Path(__file__).parent), root=str(Path(__file__).parents[2]),
                          path=str(tmp_path / "log"))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline() == "compacting\n"
        children = eventually(lambda: _children(parent.pid), timeout=120)
        parent.kill()
        parent.wait()
        eventually(lambda: not any(_alive(child) for child in children), timeout=30)
    finally:
        parent.kill()
        for child in children:
            if _alive(child):  # a failed run leaves no stalled child behind
                os.kill(child, signal.SIGKILL)
