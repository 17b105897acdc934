"""The flags of uploaded files and batches (the Files and Batches APIs)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class BatchFlags:
    """Files and batches."""

    file_storage_path: str = flag(
        "xlaserve_storage", "folder of uploaded files, batch results and their metadata "
                            "(SQLite); unfinished batches resume from it at start", path=True)
    max_file_size: int = flag(200 * 1024 * 1024, "largest file upload in bytes (413 above)")
    batch_max_lines: int = flag(50000, "most requests in one batch input file")
    batch_concurrency: Optional[int] = flag(
        None, "batch requests in flight at once, all batches together (default: "
              "--max-running-requests less an eighth, left to interactive requests)")

