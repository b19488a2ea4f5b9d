"""The node's board where prefill workers say whether they have work (:class:`node_common.core_share.BusyBoard`):
a reader sees any live writer's busy state, a writer that left or whose process is gone counts as idle, an unreadable
or missing board reads idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from node_common import core_share
from node_common.core_share import BusyBoard


def _fresh(reader: BusyBoard) -> bool:
    reader._read_at = -1.0  # past the reuse window
    return reader.any_busy()


def test_a_reader_sees_any_live_writer_busy(tmp_path):
    a, b = BusyBoard(tmp_path, "prefill-0"), BusyBoard(tmp_path, "prefill-1")
    reader = BusyBoard(tmp_path)
    assert not _fresh(reader)
    a.set(True)
    assert _fresh(reader)
    b.set(True)
    a.set(False)
    assert _fresh(reader)
    b.set(False)
    assert not _fresh(reader)
    a.set(True)
    a.close()  # it left: its file is gone
    assert not _fresh(reader)


def test_the_answer_is_reused_within_the_window(tmp_path, monkeypatch):
    w, reader = BusyBoard(tmp_path, "p"), BusyBoard(tmp_path)
    assert not reader.any_busy()
    w.set(True)
    monkeypatch.setattr(core_share, "MIN_WINDOW_S", 60.0)
    assert not reader.any_busy()  # read moments ago
    monkeypatch.setattr(core_share, "MIN_WINDOW_S", 0.0)
    time.sleep(0.001)
    assert reader.any_busy()


def test_a_dead_writers_busy_file_reads_idle(tmp_path):
    code = (f"import sys; sys.path.insert(0, {os.getcwd()!r}); from node_common.core_share import BusyBoard; "
            f"BusyBoard({str(tmp_path)!r}, 'gone').set(True)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert (tmp_path / "gone.busy").read_bytes().split()[1] == b"1"  # it said busy, then its process ended
    assert not _fresh(BusyBoard(tmp_path))


def test_a_missing_or_garbled_board_reads_idle(tmp_path):
    assert not BusyBoard(tmp_path / "nowhere").any_busy()
    (tmp_path / "x.busy").write_bytes(b"not a record")
    assert not _fresh(BusyBoard(tmp_path))
    assert core_share.board_directory("k").endswith("duet-board-k")


def test_a_board_that_cannot_be_written_is_no_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    w = BusyBoard(blocker / "board", "prefill-0")  # a worker still starts
    w.set(True)
    w.close()
    assert not _fresh(BusyBoard(blocker / "board"))
