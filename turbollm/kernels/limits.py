"""The kernels' limits that the engine plans by: plain constants, so the scheduler side and the configs read
them without loading a kernel.

`ROW_INVARIANT_ROWS` (16): within this many rows a step's matmuls compute each row alone, the quantized ones
(`kernels/quant.py` q16 / q8x2 up to `Q8X2_MAX_TOKENS`) and the dense GEMV (the C++ `dense_max_rows`), so a
row's result does not depend on the rows beside it: the scheduler puts speculative drafts into a step only
while it stays within them, and a verified row is then bit for bit the decode of its position
(tests/test_spec_decode.py holds the three equal).

`SMALL_QUERY_MAX` (8): a step in which no sequence brings more than this many tokens reads its K/V through
the decode kernel, one decode per row (kernels/csrc/ops.h `kSmallQueryMax`); a quantized K/V format's rows
then each read the ring from their own bound (attention/kv_quant.py). A verification step brings the last
sampled token and at most `SMALL_QUERY_MAX - 1` drafts (spec_decode/config.py `MAX_SPECULATIVE_TOKENS`).
"""

ROW_INVARIANT_ROWS = 16
SMALL_QUERY_MAX = 8
