// The interleaved ("repacked") weight layouts of the AVX-512 VNNI kernel family (qmm_vnni512.cpp),
// made at load by quant_repack.cpp from a GGML type's own rows, with the same bytes per row.
//
// Why: a VNNI dot product (vpdpbusd) multiplies 4 unsigned bytes by 4 signed bytes into each of
// 16 int32 lanes. With 16 weight rows in the lanes, one instruction takes 4 consecutive inputs of
// 16 rows against the same 4 inputs of one activation row (a broadcast), and each lane ends a block
// holding that row's exact integer block sum: no horizontal reductions, and the same instructions
// serve 1 activation row (decode) or 8 (a tile of a prefill chunk or a batch). Every output lane
// runs the same sequence of operations whatever the number of activation rows in the call, so a
// row's result does not depend on the others (row invariance at any batch size).
//
// A repacked tensor is uint8 [N, row_bytes] like the original (N a multiple of 16), but it holds
// groups of 16 rows: group g is bytes [16 g row_bytes, 16 (g + 1) row_bytes), and within a group
// one *unit* (a 32-block for the legacy types, a 256 super-block for the k-quants) of all 16 rows
// follows another. Inside a unit (r = row in the group 0..15, "quad j" = inputs 4j..4j+3 of a
// 32-block, i = 0..3 the input within the quad):
//   fp16 fields: 16 values, row r at 2r (d, m, dmin): one vcvtph2ps loads them as 16 lanes.
//   nib (256 B per 32-block): byte 64j + 4r + i (j = 0..3) = code[4j + i] | code[16 + 4j + i] << 4,
//        so a 64-byte load masked with 0x0F holds quad j of all 16 rows and its high nibbles quad j + 4.
//   hmask (64 B per 32-block): 8 little-endian uint64 masks; bit 4r + i of mask j = bit 4 of
//        code[4j + i] (Q5_0, Q5_1, Q5_K): a mask register adds 16 to those bytes.
//   h2 (128 B per 32-block): bytes 64t + 4r + i, bits 2j'..2j'+1 = bits 4-5 of code[4(4t + j') + i]
//        (Q6_K's two high bits; t = 0 for quads 0-3, 1 for quads 4-7).
//   codes8 (512 B per 32-block): byte 64j + 4r + i = code[4j + i] (j = 0..7; Q8_0's int8 + 128).
//   k-quant scale words (192 B): the 12 packed scale bytes of row r as three uint32 words at
//        64w + 4r (w = 0..2), unpacked for 16 rows at once by the same shifts as one row's.
//   Q6_K scales (256 B): byte 16s + r = int8 scale s of row r.
// Units, in order:
//   Q4_0 (18 B per row and block): d | nib                       = 32 + 256
//   Q4_1 (20): d | m | nib                                       = 32 + 32 + 256
//   Q5_0 (22): d | hmask | nib                                   = 32 + 64 + 256
//   Q5_1 (24): d | m | hmask | nib                               = 32 + 32 + 64 + 256
//   Q8_0 (34): d | codes8                                        = 32 + 512
//   Q4_K (144 per 256): d | dmin | scale words | 8 x nib         = 64 + 192 + 2048
//   Q5_K (176): d | dmin | scale words | 8 x hmask | 8 x nib     = 64 + 192 + 512 + 2048
//   Q6_K (210): d | scales | 8 x (nib | h2)                      = 32 + 256 + 8 x 384
// Codes are unsigned (Q8_0's shifted by +128, Q6_K's 0..63); the weight is d (code - off) for the
// _0 types (off 8, 16, 128) and Q6_K (d = d sc_s, off 32), d code + m for the _1 types, and
// (d sc_j) code - (dmin m_j) for Q4_K / Q5_K.
#pragma once
#include <cstdint>

namespace tq {

// Type ids of the repacked layouts: kRepacked + the GGML type id (the avx512_vnni form), kRepackedAmx +
// the GGML type id (the amx form: the same bytes, whole tiles of 16 rows multiplied by AMX tiles).
constexpr int kRepacked = 2000;
constexpr int kRepackedAmx = 3000;
// kRepackedAvx2 + the GGML type id: the avx2_tiles form (the same bytes, AVX2 tile kernels: qmm_avx2.cpp).
constexpr int kRepackedAvx2 = 4000;
constexpr int kGroupRows = 16;

// Whether a GGML type has a repacked layout.
bool repackable(int ggml_type);
// The 16 rows of group g of `src` (raw GGML rows, row_bytes each) into `dst` (16 * row_bytes), and back.
void repack_group(int ggml_type, const uint8_t* src, int64_t row_bytes, int64_t K, uint8_t* dst);
void unrepack_row(int ggml_type, const uint8_t* group, int r, int64_t row_bytes, int64_t K, uint8_t* dst);

}  // namespace tq
