// POSIX shared memory segments for the CPU transport: each rank creates one, the ranks exchange
// the names (through gloo) and map each other's, so rows and signal pads are plain loads and
// stores across processes.
#pragma once

#include <cstdint>
#include <string>
#include <system_error>

namespace mok::core {

// A failed system call on a segment; the bindings raise it as OSError(errno, message, name),
// which Python turns into FileNotFoundError, FileExistsError, PermissionError, ...
class ShmError : public std::system_error {
 public:
  ShmError(int errno_value, const std::string& what, std::string name)
      : std::system_error(errno_value, std::generic_category(), what), name_(std::move(name)) {}
  const std::string& name() const noexcept { return name_; }

 private:
  std::string name_;
};

// One mapping of a named segment. The creator makes it (O_CREAT | O_EXCL, zero-filled); the
// others open it and must find at least `nbytes`. Unmapped by close() or the destructor; the
// name lives on until unlink() (best right after every rank has mapped it: the mappings stay).
class ShmSegment {
 public:
  // Throws std::invalid_argument for a bad name or size, ShmError when a system call fails.
  ShmSegment(std::string name, std::int64_t nbytes, bool create);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // 0 once closed.
  std::uintptr_t address() const noexcept { return reinterpret_cast<std::uintptr_t>(addr_); }
  std::int64_t nbytes() const noexcept { return nbytes_; }
  const std::string& name() const noexcept { return name_; }
  bool created() const noexcept { return created_; }
  bool closed() const noexcept { return addr_ == nullptr; }

  void close() noexcept;  // munmap; idempotent
  void unlink();          // shm_unlink; idempotent, and a name already gone counts as done

 private:
  std::string name_;
  std::int64_t nbytes_;
  bool created_;
  bool unlinked_ = false;
  void* addr_ = nullptr;
};

}  // namespace mok::core
