"""benchmarks/gpu_clocks.py: nvidia-smi's samples recorded beside a run and summarised. A fake
nvidia-smi on PATH stands in for the driver: it answers the field probe as the driver named in
each test does, and in its sampling loop prints the lines the test gives until it is stopped."""
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_clocks  # noqa: E402

# busy at 1980 MHz, then held by the power cap (0x4) at 1755, a thermal slowdown (0x20 | 0x4),
# and one idle sample (0x1) that the reason shares leave out
LINES = ["2026/12/07 15:00:00.000, 1980, 2619, 512.3, 55, 0x0000000000000000",
         "2026/12/07 15:00:01.000, 1755, 2619, 699.8, 61, 0x0000000000000004",
         "2026/12/07 15:00:02.000, 1650, 2619, 700.1, 83, 0x0000000000000024",
         "2026/12/07 15:00:03.000, 345, 2619, 90.0, 50, 0x0000000000000001"]


def fake_smi(tmp_path, *, knows_event_reasons: bool, lines=LINES):
    """A nvidia-smi that rejects the event-reason field on an old driver and loops over `lines`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    body = "\n".join(f"  echo '{ln}'" for ln in lines)
    script = textwrap.dedent(f"""\
        #!/usr/bin/env bash
        case "$*" in
          *clocks_event_reasons.active*--format=csv,noheader) {'exit 0' if knows_event_reasons else 'exit 2'} ;;
          *clocks_throttle_reasons.active*--format=csv,noheader) exit 0 ;;
        esac
        echo "$@" > "$(dirname "$0")/args"
        trap 'exit 0' TERM
        """) + f"{body}\nwhile true; do sleep 0.05; done\n"
    smi = bin_dir / "nvidia-smi"
    smi.write_text(script)
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def test_summary_reads_clocks_power_temperature_and_reason_shares(tmp_path):
    csv = tmp_path / "clocks.csv"
    csv.write_text(",".join((*gpu_clocks.BASE_FIELDS, "clocks_event_reasons.active")) + "\n"
                   + "\n".join(LINES) + "\n")
    s = gpu_clocks.summarise(csv)
    assert s["samples"] == 4 and s["busy_samples"] == 3
    assert s["sm_mhz_median"] == (1650 + 1755) / 2 and s["sm_mhz_min"] == 345
    assert s["power_w_max"] == 700.1 and s["temperature_c_max"] == 83
    # the power cap in 2 of the 3 busy samples, the thermal slowdown in 1; the idle bit not listed
    assert s["reasons_busy_share"] == pytest.approx({"sw_power_cap": 2 / 3, "sw_thermal": 1 / 3})
    assert s["first"].endswith("15:00:00.000") and s["last"].endswith("15:00:03.000")


def test_summary_of_a_missing_or_empty_file_has_no_samples(tmp_path):
    assert gpu_clocks.summarise(tmp_path / "none.csv") == {"samples": 0}
    (tmp_path / "empty.csv").write_text("timestamp,clocks.sm\n")
    assert gpu_clocks.summarise(tmp_path / "empty.csv") == {"samples": 0}


def test_na_values_are_skipped_not_read_as_numbers(tmp_path):
    csv = tmp_path / "clocks.csv"
    csv.write_text(",".join(gpu_clocks.BASE_FIELDS) + "\n"
                   "t0, 1980, 2619, [N/A], 55\nt1, 1970, 2619, 600.0, 56\n")
    s = gpu_clocks.summarise(csv)
    assert s["power_w_median"] == 600.0 and "reasons_busy_share" not in s


@pytest.mark.parametrize("new_driver", [True, False])
def test_sampler_records_with_the_reason_field_the_driver_knows(tmp_path, monkeypatch, new_driver):
    bin_dir = fake_smi(tmp_path, knows_event_reasons=new_driver)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "run" / "clocks.csv"
    with gpu_clocks.Sampler(out, interval_ms=250, gpu=1):
        deadline = time.time() + 10
        while time.time() < deadline and len(out.read_text().splitlines()) < 5:
            time.sleep(0.05)
    field = "clocks_event_reasons.active" if new_driver else "clocks_throttle_reasons.active"
    header = out.read_text().splitlines()[0].split(",")
    assert header[-1] == field
    args = (bin_dir / "args").read_text()
    assert "--loop-ms=250" in args and "--id=1" in args and "noheader,nounits" in args
    s = gpu_clocks.summarise(out)
    assert s["samples"] == 4 and s["reasons_busy_share"]["sw_power_cap"] == pytest.approx(2 / 3)


def test_sampler_without_nvidia_smi_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi
    with gpu_clocks.Sampler(tmp_path / "c.csv") as s:
        assert s.proc is None
    assert not (tmp_path / "c.csv").exists()


def test_record_cli_stops_on_sigterm_and_summary_cli_prints_json(tmp_path):
    bin_dir = fake_smi(tmp_path, knows_event_reasons=True)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "clocks.csv"
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_clocks.py"), "record",
                          str(out), "--interval-ms", "100"], env=env)
    deadline = time.time() + 20
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 5):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=10) == 0
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_clocks.py"), "summary",
                        str(out)], capture_output=True, text=True, check=True, env=env)
    assert json.loads(r.stdout)["samples"] == 4
