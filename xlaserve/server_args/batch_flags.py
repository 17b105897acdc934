"""The flags of uploaded files and batches (the Files and Batches APIs)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from xlaserve.server_args.flag import flag


@dataclasses.dataclass
class BatchFlags:
    """Files and batches."""

    file_storage_path: Optional[str] = flag(
        None, "folder of uploaded files, batch results, stored responses and their metadata "
              "(SQLite); unfinished batches resume from it at start. One server per folder "
              "(default: xlaserve_storage/port-PORT, this port's own, so servers on other "
              "ports started from one folder each have theirs and a restart finds its batches)",
        path=True)
    max_file_size: int = flag(200 * 1024 * 1024, "largest file upload in bytes (413 above)")
    batch_max_lines: int = flag(50000, "most requests in one batch input file")
    batch_concurrency: Optional[int] = flag(
        None, "batch requests in flight at once, all batches together (default: "
              "--max-running-requests less an eighth, left to interactive requests)")

