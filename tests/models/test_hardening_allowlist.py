"""The allowed folders (`MOEVIZ_MODEL_DIRS`, `MOEVIZ_STORE_DIRS`) hold for every file a load or a store
page opens, not only for the typed folder: a link inside an allowed folder to a file outside is
refused with a message naming the link, never the target's content; each part of a comma-separated
checkpoint series is checked on its own. The pages that open them: tests/app/test_allowlist_pages.py."""

from __future__ import annotations

import pytest

from tests.support.allowlist import SECRET, allowlist_fixtures

_app_env, roots, model_in = allowlist_fixtures()


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_model_file_linked_outside_the_roots_is_refused(roots, model_in, name):
    from components import access

    allowed, outside = roots
    folder = model_in(allowed)
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(outside / "secret.txt")
    with pytest.raises(access.FolderNotAllowedError, match=name) as info:
        access.check_source(str(folder))
    assert SECRET not in str(info.value) and "outside the model folders" in str(info.value)


def test_links_that_stay_inside_the_roots_are_fine(roots, model_in):
    from components import access

    allowed, _ = roots
    folder = model_in(allowed)
    shared = allowed / "shared"
    shared.mkdir()
    (folder / "model.safetensors").rename(shared / "w.safetensors")
    (folder / "model.safetensors").symlink_to(shared / "w.safetensors")
    assert access.check_source(str(folder)) == str(folder.resolve())


def test_without_an_allowlist_any_folder_and_link_is_allowed(tmp_path, model_in):
    from components import access

    folder = model_in(tmp_path)
    (tmp_path / "elsewhere.txt").write_text("x")
    (folder / "notes.txt").symlink_to(tmp_path / "elsewhere.txt")
    assert access.check_source(str(folder)) == str(folder.resolve())


def test_a_checkpoint_linked_outside_a_series_is_refused(roots, model_in):
    from components import access

    allowed, outside = roots
    series = allowed / "series"
    series.mkdir()
    model_in(series, "step-1")
    (series / "step-2").symlink_to(model_in(outside, "step-2"), target_is_directory=True)
    with pytest.raises(access.FolderNotAllowedError, match="step-2"):
        access.check_series(str(series))


def test_a_store_file_linked_outside_the_roots_is_refused(roots):
    from components import access

    allowed, outside = roots
    run = allowed / "store" / "runs" / "model-a"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    (run / "part-0.parquet").symlink_to(outside / "secret.txt")
    with pytest.raises(access.FolderNotAllowedError, match=r"part-0\.parquet") as info:
        access.folder_inside(str(allowed / "store"), "store")
    assert SECRET not in str(info.value) and "outside the store folders" in str(info.value)
