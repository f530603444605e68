"""The clean-tree check of a test run (tests/support/git_tree.py, called by the session hook in
tests/conftest.py), on a temporary git repository: a tracked file written during the run is caught, also one
already modified before the run and rewritten (where `git status` reads " M" both times); untracked files,
ignored or not, are not."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.git_tree import change_line, changed_files, tracked_state

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-c", "commit.gpgsign=false", *args],
        cwd=repo,
        check=True,
        capture_output=True,
    )


@pytest.fixture
def repo(tmp_path):
    """A repository with two committed files and an ignored folder; a.txt modified (not committed)."""
    (tmp_path / "a.txt").write_text("a\n")
    (tmp_path / "b.txt").write_text("b\n")
    (tmp_path / ".gitignore").write_text("out/\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "start")
    (tmp_path / "a.txt").write_text("a, edited before the run\n")
    return tmp_path


def test_rewriting_a_file_already_modified_is_caught(repo):
    before = tracked_state(repo)
    assert set(before) == {"a.txt"} and before["a.txt"].startswith(" M ")
    (repo / "a.txt").write_text("a, rewritten by a test\n")
    after = tracked_state(repo)
    assert after["a.txt"][:2] == before["a.txt"][:2] == " M"  # the status alone cannot tell
    assert changed_files(before, after) == ["a.txt"]
    assert change_line("a.txt", before, after) == "a.txt (' M' → ' M')"


def test_the_same_content_written_again_is_no_change(repo):
    before = tracked_state(repo)
    (repo / "a.txt").write_text((repo / "a.txt").read_text())
    assert changed_files(before, tracked_state(repo)) == []


def test_writing_a_clean_file_deleting_one_and_restoring_one_are_caught(repo):
    before = tracked_state(repo)
    (repo / "b.txt").write_text("b, written by a test\n")
    (repo / ".gitignore").unlink()
    (repo / "a.txt").write_text("a\n")  # back to what HEAD holds: `git status` no longer lists it
    after = tracked_state(repo)
    assert changed_files(before, after) == [".gitignore", "a.txt", "b.txt"]
    assert change_line("a.txt", before, after) == "a.txt (' M' → clean)"
    assert change_line("b.txt", before, after) == "b.txt (clean → ' M')"


def test_untracked_files_ignored_or_not_do_not_count(repo):
    before = tracked_state(repo)
    (repo / "out").mkdir()
    (repo / "out" / "screenshot.png").write_bytes(b"\x89PNG")  # ignored
    (repo / "notes.txt").write_text("untracked\n")  # untracked, not ignored
    assert changed_files(before, tracked_state(repo)) == []


def test_outside_a_checkout_there_is_nothing_to_compare(tmp_path):
    assert tracked_state(tmp_path) is None
