// POSIX shared memory segments (see shm.h).
#include "shm.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <stdexcept>
#include <utility>

namespace mok::core {
namespace {

// Linux's rule (and POSIX's portable one): "/" then 1..NAME_MAX-1 characters, none a "/".
void check_name(const std::string& name) {
  if (name.size() < 2 || name.front() != '/' || name.find('/', 1) != std::string::npos ||
      name.find('\0') != std::string::npos || name.size() > NAME_MAX) {
    throw std::invalid_argument(
        "ShmSegment: name must be \"/\" followed by 1 to " + std::to_string(NAME_MAX - 1) +
        " characters, none of them \"/\" or NUL (e.g. \"/mok-1234-0\"), got \"" + name + "\"");
  }
}

// Closes fd, keeping errno for the caller's error report.
void close_keeping_errno(int fd) {
  const int saved = errno;
  ::close(fd);
  errno = saved;
}

}  // namespace

ShmSegment::ShmSegment(std::string name, std::int64_t nbytes, bool create)
    : name_(std::move(name)), nbytes_(nbytes), created_(create) {
  check_name(name_);
  if (nbytes_ <= 0) {
    throw std::invalid_argument("ShmSegment: nbytes must be > 0, got " + std::to_string(nbytes_));
  }
  const int fd = create ? ::shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600)
                        : ::shm_open(name_.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    throw ShmError(err,
                   create ? "ShmSegment: cannot create \"" + name_ + "\" (shm_open)"
                          : "ShmSegment: cannot open \"" + name_ +
                                "\" (shm_open; the creating rank makes it first)",
                   name_);
  }
  // A failure past this point leaves nothing behind: the descriptor is closed and a segment this
  // call created is unlinked again.
  const auto fail = [&](const std::string& call) {
    const int err = errno;
    close_keeping_errno(fd);
    if (create) ::shm_unlink(name_.c_str());
    throw ShmError(err, "ShmSegment: \"" + name_ + "\": " + call + " failed", name_);
  };
  if (create) {
    // New pages of a grown segment read as zero: the pads start at epoch 0.
    int rc;
    do {
      rc = ::ftruncate(fd, static_cast<off_t>(nbytes_));
    } while (rc != 0 && errno == EINTR);
    if (rc != 0) fail("ftruncate to " + std::to_string(nbytes_) + " bytes");
  } else {
    struct stat st{};
    if (::fstat(fd, &st) != 0) fail("fstat");
    if (static_cast<std::int64_t>(st.st_size) < nbytes_) {
      ::close(fd);
      throw std::invalid_argument(
          "ShmSegment: nbytes " + std::to_string(nbytes_) + " exceeds the size of \"" + name_ +
          "\" (" + std::to_string(static_cast<std::int64_t>(st.st_size)) + " bytes)");
    }
  }
  void* addr =
      ::mmap(nullptr, static_cast<size_t>(nbytes_), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (addr == MAP_FAILED) fail("mmap of " + std::to_string(nbytes_) + " bytes");
  ::close(fd);  // the mapping keeps the segment
  addr_ = addr;
}

ShmSegment::~ShmSegment() { close(); }

void ShmSegment::close() noexcept {
  if (addr_ != nullptr) {
    ::munmap(addr_, static_cast<size_t>(nbytes_));
    addr_ = nullptr;
  }
}

void ShmSegment::unlink() {
  if (unlinked_) return;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
    const int err = errno;
    throw ShmError(err, "ShmSegment: cannot unlink \"" + name_ + "\" (shm_unlink)", name_);
  }
  unlinked_ = true;
}

}  // namespace mok::core
