"""Sources: one recipe source -> a `datasets.Dataset` of its raw rows, or a DataError naming the bad row.

A local file is read by its extension, a local folder as a `save_to_disk` folder or a dataset folder, and
anything else as a hub dataset id. Rows are numbered from 1 in the order the source yields them.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import datasets

from llmtune.data.render import DataError, source_fields
from llmtune.data.validate import check_row
from llmtune.recipe import SourceConfig

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


def load_source(src: SourceConfig) -> datasets.Dataset:
    """Read one source into a Dataset. Local paths by extension; anything else is a hub dataset id."""
    path = Path(src.path).expanduser()
    try:
        if path.is_file():
            ds = _load_file(path)
        elif path.is_dir():
            ds = _load_folder(path, src.split)
        elif on_hub(src.path):
            ds = datasets.load_dataset(src.path, src.subset, split=src.split)
        else:
            raise DataError(f"{src.path}: no such file or folder")
    except DataError:
        raise
    except Exception as err:  # datasets raises many types; each one means the same thing here
        raise DataError(_explain_unreadable(src, path, err)) from err
    if len(ds) == 0:
        raise DataError(f"{src.path}: row 1: no rows (empty file or split {src.split!r})")
    return ds


def on_hub(name: str) -> bool:
    """Whether `load_source` reads `name` from the hub: no local file or folder, and not shaped like a local path
    (./x, /x, ~/x, or a data file's extension: those are refused as missing without asking the hub)."""
    path = Path(name).expanduser()
    return not path.exists() and not name.startswith((".", "/", "~")) and path.suffix not in FILE_BUILDERS


def _load_file(path: Path) -> datasets.Dataset:
    builder = FILE_BUILDERS.get(_suffix(path))
    if builder is None:
        raise DataError(f"{path}: unsupported file type (use one of {', '.join(FILE_BUILDERS)})")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: row 1: file is empty")
    if builder in ("json", "csv"):
        _check_utf8(path)
    extra = {"features": _csv_as_text(path)} if builder == "csv" else {}
    return datasets.load_dataset(builder, data_files=str(path), split="train", **extra)


def _load_folder(path: Path, split: str) -> datasets.Dataset:
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(path))
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    return datasets.load_dataset(str(path), split=split)


def _check_utf8(path: Path) -> None:
    """A text file's first line that is not UTF-8, named: pyarrow reads such bytes into its strings and fails only
    when a value is taken out, mid-tokenisation, with no file or row."""
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                where = f"row {number}" if _suffix(path) == ".jsonl" else f"line {number}"
                raise DataError(
                    f"{path}: {where}: not UTF-8 (byte {line[bad.start]:#04x} at column {bad.start + 1}); save the"
                    " file as UTF-8"
                ) from None


def _csv_as_text(path: Path) -> datasets.Features:
    """Every CSV column as text: pandas would otherwise turn a column of answers like "42" into ints."""
    with path.open(newline="", encoding="utf-8", errors="replace") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _suffix(path: Path) -> str:
    return path.suffix.lower()


def _explain_unreadable(src: SourceConfig, path: Path, err: Exception) -> str:
    """Name the first bad row of an unreadable JSON Lines file; otherwise pass on the reader's error."""
    if path.is_file() and _suffix(path) == ".jsonl":
        problem = _first_bad_jsonl_row(src, path)
        if problem:
            return problem
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    cause = err.__cause__
    if cause is not None and str(cause).strip():
        message += f" ({str(cause).strip().splitlines()[0]})"
    return f"{src.path}: cannot read: {message}"


def _first_bad_jsonl_row(src: SourceConfig, path: Path) -> str | None:
    """`<path>: row N: ...` for the first line that is not JSON, not an object, or has a bad field."""
    with path.open(encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as bad:
                return f"{path}: row {number}: not valid JSON ({bad.msg} at column {bad.colno})"
            if not isinstance(row, dict):
                return f"{path}: row {number}: expected a JSON object, got {type(row).__name__}"
            fields = source_fields(src, list(row))
            problem = check_row({name: row.get(column) for name, column in fields.items()}, fields)
            if problem:
                return f"{path}: row {number}: field `{problem[0]}`: {problem[1]}"
    return None
