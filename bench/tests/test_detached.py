"""bench.tools.detached: a job started detached runs on after ``start`` returns; ``poll`` waits for it, says how
it ended and copies the files named."""

import time

import pytest

from bench.tools import detached


def test_a_job_runs_after_start_returns_and_poll_reports_its_end(tmp_path, capsys):
    job = tmp_path / "job"
    started = time.monotonic()
    detached.main(["start", str(job), "--", f"sleep 1; echo hello; echo '{{}}' > {job}/result.json; exit 4"])
    assert time.monotonic() - started < 1.0  # start does not wait for the job
    assert not (job / "rc").exists()
    out = tmp_path / "out"
    assert detached.main(["poll", str(job), "--seconds", "30", "--copy", "*.json", "--to", str(out)]) == 1
    report = capsys.readouterr().out
    assert "ended with 4" in report and "hello" in report
    assert (out / "result.json").read_text().strip() == "{}"
    assert not (out / "log").exists()  # only what a pattern names comes back


def test_poll_says_a_job_still_runs_when_the_wait_ends_first(tmp_path, capsys):
    job = tmp_path / "job"
    detached.main(["start", str(job), "--", "sleep", "3"])  # several words: quoted one by one
    assert detached.main(["poll", str(job), "--seconds", "0.2"]) == detached.RUNNING
    assert "still running" in capsys.readouterr().out
    assert detached.main(["poll", str(job), "--seconds", "30"]) == 0
    assert "ended with 0" in capsys.readouterr().out


def test_poll_of_a_folder_without_a_job_fails(tmp_path, capsys):
    assert detached.main(["poll", str(tmp_path), "--seconds", "0"]) == 2
    assert "no job was started" in capsys.readouterr().err


def test_start_without_a_command_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        detached.main(["start", str(tmp_path / "job"), "--"])
