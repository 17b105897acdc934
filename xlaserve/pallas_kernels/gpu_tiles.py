"""Column tiles of the Pallas GPU matmuls (fp8_block_matmul.py, grouped_matmul_gpu.py): how wide a
program's slice of the output's columns is, so that a grid of few row blocks still fills the GPU."""
from __future__ import annotations

H100_SMS = 132
# Triton's dot wants power-of-two tiles of at least 16 along every dimension.
BLOCK_N_CHOICES = (128, 64, 32, 16)


def column_tile(n: int, row_blocks: int, programs: int = H100_SMS) -> int:
    """The widest column tile that divides N and still gives the grid `programs` programs over
    `row_blocks` row blocks (a decode step's FP8 o_proj, N = 4096 in one row block: 32-wide, 128
    programs), at least 32 wide where N allows."""
    fitting = [b for b in BLOCK_N_CHOICES if n % b == 0]
    for block_n in fitting:
        if row_blocks * (n // block_n) >= programs or block_n == 32:
            return block_n
    return fitting[-1]
