"""files.atomic_dir: a folder appears whole or not at all, and a killed writer's leftovers go."""

from pathlib import Path

from mtplm.files import atomic_dir


def test_a_save_clears_the_half_written_folder_of_a_killed_save(tmp_path: Path) -> None:
    stale = tmp_path / ".state.k1ll3d"  # what a SIGKILL in the middle of a save leaves beside the target
    stale.mkdir()
    (stale / "part").write_text("half")
    target = atomic_dir(tmp_path / "state", lambda tmp: (tmp / "done").write_text("whole"))
    assert (target / "done").read_text() == "whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
