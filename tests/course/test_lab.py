"""``mpcourse lab``: the command it builds, the root refusal, and a real server rooted at the course.

The last test starts JupyterLab's server for a few seconds on a free local port and lists the
course folders through its REST API (``/api/contents``), as JupyterLab's file browser does.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from mpcourse.course import learner
from mpcourse.course.exercises import ROOT


def test_command_is_this_interpreters_jupyterlab_rooted_at_the_course(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT / "notebooks")                      # from a subfolder: still the repository root
    assert learner.course_root() == ROOT
    assert learner.lab(["--print-command", "--no-browser", "--port", "8899"]) == 0
    assert capsys.readouterr().out.split() == [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT}",
                                               "--no-browser", "--port", "8899"]
    outside = tmp_path / "course"
    (outside / "notebooks").mkdir(parents=True)
    (outside / "exercises").mkdir()
    assert learner.course_root(outside / "notebooks") == outside


def test_root_is_told_the_fix_before_jupyter_refuses(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)
    monkeypatch.setattr(os, "execv", lambda *a: pytest.fail("must not start jupyter as root"))
    assert learner.lab(["--no-browser"]) == 2
    err = capsys.readouterr().err
    assert "root" in err and "--allow-root" in err and len(err.strip().splitlines()) == 1
    started = []
    monkeypatch.setattr(os, "execv", lambda path, cmd: started.append(cmd))
    assert learner.lab(["--no-browser", "--allow-root"]) == 0
    assert started and "--allow-root" in started[0]
    monkeypatch.setattr(os, "geteuid", lambda: 1000, raising=False)
    assert learner.refused_as_root(["--no-browser"]) is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_server_serves_lessons_exercises_and_solutions(tmp_path):
    pytest.importorskip("jupyterlab")
    port, token = free_port(), "mpcourse-test-token"
    args = ["--no-browser", f"--port={port}", "--ServerApp.port_retries=0", "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={token}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")
    log = open(tmp_path / "lab.log", "w")                   # a file, not a pipe nobody reads (it could fill)
    proc = subprocess.Popen([sys.executable, "-m", "mpcourse", "lab", *args], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        listing, deadline = None, time.monotonic() + 90
        while listing is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents/",
                                             headers={"Authorization": f"token {token}"})
                listing = json.load(urllib.request.urlopen(req, timeout=5))
            except OSError:
                time.sleep(0.5)
        assert listing is not None, f"the server did not answer: {(tmp_path / 'lab.log').read_text()[-3000:]}"
        names = {c["name"] for c in listing["content"]}
        assert {"notebooks", "exercises", "solutions"} <= names
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api/contents/exercises",
                                     headers={"Authorization": f"token {token}"})
        exercises = {c["name"] for c in json.load(urllib.request.urlopen(req, timeout=5))["content"]}
        assert "04_dynamic_loss_scaling.ipynb" in exercises
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
