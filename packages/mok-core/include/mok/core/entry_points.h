// mok-core's checked host entry points as plain function pointers, for another extension module to
// call inside one of its own calls: mok-bf16's forward call issues the schedule table, the
// megakernel and the combine in one crossing from Python (docs/megakernel.md, "The host").
//
// The table travels between the two modules as a PyCapsule named kEntryPointsCapsule
// (mok_core._C.entry_points()). The modules are separate shared objects, so nothing but plain
// data crosses: each entry point catches what the checked call throws and returns a status with
// the message; the receiver checks the version and the argument structs' sizes before its first
// call, so that wheels built from different sources refuse each other instead of misreading the
// arguments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "mok/core/epilogue.h"  // CombineArgs
#include "mok/core/schedule.h"  // TableArgs

namespace mok::core {

inline constexpr const char* kEntryPointsCapsule = "mok_core.entry_points";
inline constexpr std::uint32_t kEntryPointsVersion = 2;

// An entry point's result: kOk, or the kind of exception the checked call threw.
enum EntryStatus : int { kEntryOk = 0, kEntryInvalidArgument = 1, kEntryRuntimeError = 2 };

// build_table / combine (schedule_impl.h, epilogue_impl.h) on `device` ("cpu" or "cuda"; `stream`
// a cudaStream_t as an integer). Where the status is not kEntryOk, `message` (message_bytes, at
// least 1) holds why, NUL-terminated and cut to fit.
using BuildTableEntry = int (*)(const char* device, const TableArgs* args, std::uintptr_t stream,
                                char* message, std::size_t message_bytes) noexcept;
using CombineEntry = int (*)(const char* device, const CombineArgs* args, std::uintptr_t stream,
                             char* message, std::size_t message_bytes) noexcept;

struct EntryPoints {
  std::uint32_t version;             // kEntryPointsVersion
  std::uint32_t table_args_bytes;    // sizeof(TableArgs) where the table was made
  std::uint32_t combine_args_bytes;  // sizeof(CombineArgs) where the table was made
  BuildTableEntry build_table;
  CombineEntry combine;
};

// The receiver's check of a table it was handed (null: none). Throws std::runtime_error naming
// the mismatch.
inline const EntryPoints& checked_entry_points(const void* table) {
  const auto* t = static_cast<const EntryPoints*>(table);
  if (t == nullptr) throw std::runtime_error("mok-core's entry points: none given");
  if (t->version != kEntryPointsVersion || t->table_args_bytes != sizeof(TableArgs) ||
      t->combine_args_bytes != sizeof(CombineArgs)) {
    throw std::runtime_error(
        "mok-core's entry points do not match the mok-core headers this module was built "
        "against (version " +
        std::to_string(t->version) + ", expected " + std::to_string(kEntryPointsVersion) +
        "): install mok-core and mok-bf16 from the same source");
  }
  return *t;
}

// Rethrows an entry point's status as the exception the checked call threw (pybind11 makes
// std::invalid_argument a ValueError).
inline void raise_entry_status(int status, const char* message) {
  if (status == kEntryOk) return;
  if (status == kEntryInvalidArgument) throw std::invalid_argument(message);
  throw std::runtime_error(message);
}

// This module's table (mok-core's own build; src/entry_points.cpp).
const EntryPoints& entry_points();

}  // namespace mok::core
