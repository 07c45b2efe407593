"""The ``gpupool`` command line: ``bench`` prints the seed article's table with local figures."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from gpupool import cli

ROW = re.compile(r"^\| (.+?) \| (\d+\.\d{3}) \| (\d+\.\d{3}) \| (\d+\.\d)x \|$")


@pytest.mark.parametrize("device", ["host", "sim"])
def test_bench_prints_three_workloads(capsys, device):
    assert cli.main(["bench", "--device", device, "--repeat", "1"]) == 0
    output = capsys.readouterr().out
    assert f"device {device}, repeat 1, median times" in output
    assert "| workload | direct (ms) | pool (ms) | speed-up |" in output
    rows = [match.group(1) for match in map(ROW.match, output.splitlines()) if match]
    assert rows == [name for name, _, _ in cli.WORKLOADS]


def test_bench_rejects_a_zero_repeat(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--repeat", "0"])
    assert "at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--capacity", "1e400"], r"^gpupool bench: capacity: unknown size unit in '1e400'$"),
        (["--capacity", "0"], r"^gpupool bench: capacity must be positive$"),
        (["--device", "sim", "--capacity", "1MiB"], r"^gpupool bench: device refused an allocation of 1048576 bytes$"),
    ],
)
def test_bench_errors_exit_with_one_line(argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["bench", "--repeat", "1", *argv])


def test_module_runs_as_a_script():
    result = subprocess.run([sys.executable, "-m", "gpupool", "--help"], capture_output=True, text=True, check=True)
    assert "bench" in result.stdout
