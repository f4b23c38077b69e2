"""The GPU's SM clock, power, temperature and clock-event reasons beside a timed run.

Two runs of the same code on two machines of one kind, or a long run beside a short benchmark on
one machine, can differ by more than the change they compare: a card held below its boost clock
by its power cap or its temperature runs the compute-bound GEMMs slower and the memory-bound
kernels not. `nvidia-smi` samples what the card ran at; this module records and summarises it.

  python benchmarks/gpu_clocks.py record OUT.csv [--interval-ms 1000] [--gpu 0]
      # samples until SIGTERM / SIGINT (gsm8k_h200.sh starts one beside each trainer run)
  python benchmarks/gpu_clocks.py summary OUT.csv      # the summary below as JSON

In Python, `Sampler(path)` records around a block and `summarise(path)` reads the file back:
samples, SM clock (median / p10 / min MHz), memory clock, power (median / max W), temperature
(max C) and the share of busy samples with each clock-event reason (power cap, thermal, ...).
Without nvidia-smi (CPU machines) recording writes nothing and the summary is {"samples": 0}.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from hybridflow.gpu_monitor import IDLE, REASONS  # noqa: E402  (NVML's reason bits)

BASE_FIELDS = ("timestamp", "clocks.sm", "clocks.mem", "power.draw", "temperature.gpu")
# nvidia-smi renamed the throttle reasons to clock-event reasons; older drivers know only the first
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def query_fields(smi: str = "nvidia-smi") -> tuple:
    """The fields this driver's nvidia-smi answers: BASE_FIELDS and the first reason field it
    knows (none where it knows neither)."""
    for field in REASON_FIELDS:
        r = subprocess.run([smi, f"--query-gpu={field}", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if r.returncode == 0:
            return (*BASE_FIELDS, field)
    return BASE_FIELDS


class Sampler:
    """`with Sampler(path):` nvidia-smi writes one CSV line per interval to `path` (a header line
    of the fields first) until the block ends; nothing where nvidia-smi is not installed."""

    def __init__(self, path, *, interval_ms: int = 1000, gpu: int = 0, smi: str = "nvidia-smi"):
        self.path, self.interval_ms, self.gpu, self.smi = Path(path), interval_ms, gpu, smi
        self.proc = None

    def __enter__(self):
        if shutil.which(self.smi) is None:
            return self
        fields = query_fields(self.smi)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")
        self._file.write(",".join(fields) + "\n")
        self._file.flush()
        self.proc = subprocess.Popen(
            [self.smi, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
             f"--loop-ms={self.interval_ms}", f"--id={self.gpu}"], stdout=self._file,
            stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._file.close()
            self.proc = None
        return False


def _num(s: str):
    try:
        return float(s)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def summarise(path) -> dict:
    """The samples of a recorded CSV: clocks, power, temperature and, over the samples the GPU was
    busy (the idle bit clear), the share with each clock-event reason."""
    path = Path(path)
    if not path.is_file():
        return {"samples": 0}
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    if len(lines) < 2:
        return {"samples": 0}
    fields = lines[0].split(",")
    rows = [dict(zip(fields, (c.strip() for c in ln.split(",")))) for ln in lines[1:]]
    rows = [r for r in rows if len(r) == len(fields)]
    col = {f: [v for v in (_num(r[f]) for r in rows) if v is not None] for f in BASE_FIELDS[1:]}
    out: dict = {"samples": len(rows), "first": rows[0]["timestamp"] if rows else None,
                 "last": rows[-1]["timestamp"] if rows else None}

    def stat(name, values, *, p10=False, low=False, high=False):
        if not values:
            return
        out[f"{name}_median"] = statistics.median(values)
        if p10:
            out[f"{name}_p10"] = sorted(values)[len(values) // 10]
        if low:
            out[f"{name}_min"] = min(values)
        if high:
            out[f"{name}_max"] = max(values)

    stat("sm_mhz", col["clocks.sm"], p10=True, low=True)
    stat("mem_mhz", col["clocks.mem"])
    stat("power_w", col["power.draw"], high=True)
    stat("temperature_c", col["temperature.gpu"], high=True)
    reason = next((f for f in REASON_FIELDS if f in fields), None)
    if reason:
        masks = [int(r[reason], 16) for r in rows if r[reason].lower().startswith("0x")]
        busy = [m for m in masks if not m & IDLE]
        out["busy_samples"] = len(busy)
        out["reasons_busy_share"] = {name: sum(1 for m in busy if m & bit) / len(busy)
                                     for bit, name in REASONS.items()
                                     if bit != IDLE and busy and any(m & bit for m in busy)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="sample until SIGTERM / SIGINT")
    rec.add_argument("out")
    rec.add_argument("--interval-ms", type=int, default=1000)
    rec.add_argument("--gpu", type=int, default=0)
    summ = sub.add_parser("summary", help="a recorded CSV's summary as JSON")
    summ.add_argument("csv")
    a = ap.parse_args(argv)
    if a.cmd == "summary":
        print(json.dumps(summarise(a.csv), indent=1))
        return 0
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    with Sampler(a.out, interval_ms=a.interval_ms, gpu=a.gpu) as s:
        if s.proc is None:
            return 0
        while not stop and s.proc.poll() is None:
            time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
