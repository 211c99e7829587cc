"""Run a long GPU job across several device calls: start it detached, then poll it from each next call.

A lent machine runs one call for at most 10 minutes and goes back about 30 s after the last call ends, with
whatever it was running; a sweep, an A/B and the GPU suite together take longer. So the first call starts the
job detached from the call's process group and the following calls each wait on it for most of their time:

    python -m bench.tools.detached start /tmp/job -- bash my_steps.sh      # returns at once
    python -m bench.tools.detached poll /tmp/job --seconds 540 --copy '*.json' --copy steps.log

``start`` runs the command under ``bash -c`` in a new session (a single word is taken as a shell line, so
``-- 'a && b'`` runs both; several words are quoted one by one), its output in ``DIR/log`` and, once it ends,
its exit status in ``DIR/rc``. ``poll`` returns when ``DIR/rc`` appears or after ``--seconds``, prints whether
the job is running or how it ended and the log's last lines, and copies the files of ``DIR`` that match each
``--copy`` pattern into ``--to`` (default ``$OUT``, the folder a device call brings back; only a limited
number of files come back, so name what you need). Exit status: 0 when the job ended with 0, 1 when it
ended otherwise, 3 while it still runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

RUNNING = 3


def start(job: Path, command: list[str]) -> None:
    """Start ``command`` detached: its output in ``job/log``, its exit status in ``job/rc`` when it ends."""
    job.mkdir(parents=True, exist_ok=True)
    for stale in ("rc", "rc.part", "log"):
        (job / stale).unlink(missing_ok=True)
    line = command[0] if len(command) == 1 else shlex.join(command)  # one word: a shell line, as is
    (job / "command").write_text(line + "\n")
    # a subshell, so that an `exit` in the line still leaves the status to record
    rc = shlex.quote(str(job / "rc"))  # written whole (renamed into place): a poll never reads it half-written
    script = f"(\n{line}\n)\necho $? > {rc}.part && mv {rc}.part {rc}"
    with open(job / "log", "wb") as log:
        subprocess.Popen(
            ["bash", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def poll(job: Path, seconds: float, patterns: list[str], to: Path | None, lines: int = 20) -> int:
    """Wait up to ``seconds`` for the job to end; report it, copy what ``patterns`` match into ``to``."""
    if not (job / "command").exists():
        print(f"{job}: no job was started there", file=sys.stderr)
        return 2
    deadline = time.monotonic() + seconds
    while not (job / "rc").exists() and time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    rc_text = (job / "rc").read_text().strip() if (job / "rc").exists() else ""
    if to is not None:
        to.mkdir(parents=True, exist_ok=True)
        for pattern in patterns:
            for path in sorted(job.glob(pattern)):
                if path.is_file():
                    target = to / path.relative_to(job)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, target)
    log = (job / "log").read_text(errors="replace").splitlines() if (job / "log").exists() else []
    state = f"ended with {rc_text}" if rc_text else "still running"
    print(f"{job}: {(job / 'command').read_text().strip()}: {state}")
    print("\n".join(log[-lines:]))
    if not rc_text:
        return RUNNING
    return 0 if rc_text == "0" else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tools.detached", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p_start = sub.add_parser("start", help="start a command detached: DIR -- COMMAND...")
    p_start.add_argument("job", type=Path)
    p_start.add_argument("command", nargs=argparse.REMAINDER)
    p_poll = sub.add_parser("poll", help="wait for a job, report it, copy its files")
    p_poll.add_argument("job", type=Path)
    p_poll.add_argument("--seconds", type=float, default=540.0, help="the longest wait (default %(default)s)")
    p_poll.add_argument("--copy", action="append", default=[], metavar="PATTERN", help="files of DIR to copy")
    p_poll.add_argument("--to", type=Path, default=None, help="where to copy them (default $OUT)")
    p_poll.add_argument("--lines", type=int, default=20, help="the log's last lines to print")
    args = parser.parse_args(argv)
    if args.action == "start":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("start: no command given (DIR -- COMMAND...)")
        start(args.job, command)
        return 0
    to = args.to if args.to is not None else (Path(os.environ["OUT"]) if "OUT" in os.environ else None)
    return poll(args.job, args.seconds, args.copy, to, args.lines)


if __name__ == "__main__":
    sys.exit(main())
