# Type stubs of the compiled module mok_mxfp8._C.
from typing import Any

def version() -> str: ...
def build_info() -> dict[str, Any]: ...
def quantize(
    device: str,
    src: int,
    src_dtype: str,
    batch: int,
    rows: int,
    cols: int,
    src_batch_stride: int,
    src_row_stride: int,
    src_col_stride: int,
    data: int,
    scales: int,
    scale_row_stride: int,
    scale_block_stride: int,
    rule: str = "rceil",
    num_threads: int = 1,
    stream: int = 0,
) -> None: ...
