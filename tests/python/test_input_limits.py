"""Files the keel package reads (configs, traces) go through the library's bounded reader: a
FIFO, a device or a file beyond its limit raises InvalidArgumentError naming the path, without
blocking, and the limits follow their environment variables (docs/config.md, "Input limits")."""

from __future__ import annotations

import os

import pytest

import keel


def test_what_is_not_a_regular_file_is_refused_by_name(tmp_path) -> None:
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    with pytest.raises(keel.InvalidArgumentError, match=r"config.yaml: is a FIFO \(named pipe\)"):
        keel.Config.from_file(str(fifo))
    with pytest.raises(keel.InvalidArgumentError, match="/dev/zero: is a character device"):
        keel.Config.from_file("/dev/zero")
    with pytest.raises(keel.InvalidArgumentError, match="/dev/urandom: is a character device"):
        keel.read_trace("/dev/urandom", format="keel")
    trace = tmp_path / "t.jsonl"
    os.mkfifo(trace)
    with pytest.raises(keel.InvalidArgumentError, match=r"t.jsonl: is a FIFO \(named pipe\)"):
        keel.read_trace(str(trace))


def test_limits_follow_their_variables(tmp_path, monkeypatch) -> None:
    large = tmp_path / "large.jsonl"
    with open(large, "wb") as f:
        f.truncate(2 << 30)  # sparse: no disk used
    with pytest.raises(keel.InvalidArgumentError,
                       match=r"2 GiB is more than the limit of 1 GiB for a trace file \(set "
                             r"KEEL_MAX_TRACE_BYTES to raise it\)"):
        keel.read_trace(str(large), format="keel")
    config = tmp_path / "c.yaml"
    config.write_text("policy:\n  name: static\n")
    assert keel.Config.from_file(str(config)).policy == "static"
    monkeypatch.setenv("KEEL_MAX_CONFIG_BYTES", "16")
    with pytest.raises(keel.InvalidArgumentError,
                       match="23 bytes is more than the limit of 16 bytes for a config file"):
        keel.Config.from_file(str(config))
    monkeypatch.setenv("KEEL_MAX_CONFIG_BYTES", "sixteen")
    with pytest.raises(keel.InvalidArgumentError, match="KEEL_MAX_CONFIG_BYTES='sixteen'"):
        keel.Config.from_file(str(config))
