// mok-core's entry points for other extension modules (include/mok/core/entry_points.h).
#include "mok/core/entry_points.h"

#include <cstring>
#include <exception>
#include <stdexcept>

#include "epilogue_impl.h"
#include "schedule_impl.h"

namespace mok::core {
namespace {

void write_message(char* message, std::size_t bytes, const char* what) {
  if (message == nullptr || bytes == 0) return;
  std::strncpy(message, what, bytes - 1);
  message[bytes - 1] = '\0';
}

// Runs `call`, turning what it throws into a status and a message.
template <class Call>
int guarded(Call&& call, char* message, std::size_t bytes) noexcept {
  try {
    call();
    return kEntryOk;
  } catch (const std::invalid_argument& e) {
    write_message(message, bytes, e.what());
    return kEntryInvalidArgument;
  } catch (const std::exception& e) {
    write_message(message, bytes, e.what());
    return kEntryRuntimeError;
  } catch (...) {
    write_message(message, bytes, "mok-core: an unknown error");
    return kEntryRuntimeError;
  }
}

int build_table_entry(const char* device, const TableArgs* args, std::uintptr_t stream,
                      char* message, std::size_t bytes) noexcept {
  return guarded([&] { build_table(device, *args, stream); }, message, bytes);
}

int combine_entry(const char* device, const CombineArgs* args, std::uintptr_t stream, char* message,
                  std::size_t bytes) noexcept {
  return guarded([&] { combine(device, *args, stream); }, message, bytes);
}

}  // namespace

const EntryPoints& entry_points() {
  static const EntryPoints table{kEntryPointsVersion, sizeof(TableArgs), sizeof(CombineArgs),
                                 &build_table_entry, &combine_entry};
  return table;
}

}  // namespace mok::core
