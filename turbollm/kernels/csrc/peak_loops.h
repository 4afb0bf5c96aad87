// Instruction-rate ceilings (peak_loops.cpp): one register-only multiply-add loop per form.
#pragma once
#include <cstdint>

namespace tq {
namespace peak {

struct Loop {
  const char* name;        // "int8_vnni512", "int8_avx2", "bf16_avx512", "fp32_avx512", "fp32_avx2", "int8_amx"
  double macs_per_iter;    // multiply-adds one iteration of the loop does
  double (*run)(int64_t);  // n iterations; returns a checksum (keeps the loop alive)
  const char* feature;     // what the CPU must have
};

const Loop* find(const char* name);  // nullptr for an unknown name
bool runs(const Loop& loop);         // whether this CPU has the loop's instructions

}  // namespace peak
}  // namespace tq
