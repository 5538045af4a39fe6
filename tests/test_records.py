"""records/ in git stays small and readable: each tracked file under 100 KB, all of them under 1 MB,
every summary a valid one whose full file's sha256 records/README.md lists. CPU only."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from musebench.harness import summary

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDS = ROOT / "records"


def _tracked() -> list[pathlib.Path]:
    try:
        listing = subprocess.run(["git", "ls-files", "-z", "records"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout", allow_module_level=True)
    return [ROOT / name for name in listing.stdout.decode().split("\0") if name]


TRACKED = _tracked()
SUMMARIES = [path for path in TRACKED if path.name.endswith(".summary.json")]


def test_records_hold_summaries():
    assert len(SUMMARIES) >= 1
    assert (RECORDS / "README.md") in TRACKED


@pytest.mark.parametrize("path", TRACKED, ids=[path.name for path in TRACKED])
def test_each_record_is_under_the_file_limit(path):
    assert path.stat().st_size < summary.RECORD_LIMIT_BYTES, f"{path.name}: compact it (scripts/compact-records.py)"


def test_records_together_are_under_the_total_limit():
    assert sum(path.stat().st_size for path in TRACKED) < summary.RECORDS_LIMIT_BYTES


def test_no_full_run_record_is_tracked():
    for path in TRACKED:
        assert path.suffix != ".xml", f"{path.name}: JUnit XML goes in as its summary"
        if path.suffix == ".json" and path not in SUMMARIES:
            assert "cases" not in json.loads(path.read_text()), f"{path.name}: a full run record; commit its summary"


@pytest.mark.parametrize("path", SUMMARIES, ids=[path.name for path in SUMMARIES])
def test_each_summary_parses_has_its_keys_and_is_indexed(path):
    data = json.loads(path.read_text(encoding="utf-8"))
    assert summary.check_summary(data) == []
    source = data["source"]
    assert {"file", "bytes", "sha256"} <= set(source) and len(source["sha256"]) == 64
    readme = (RECORDS / "README.md").read_text(encoding="utf-8")
    assert f"`{path.name}`" in readme and source["sha256"] in readme
    if data["format"] == summary.RUN_FORMAT:
        assert all(data[key] for key in ("date", "gpu", "commit", "command"))
        for row in summary.case_rows(data):
            assert set(row) == set(summary.CASE_FIELDS)
