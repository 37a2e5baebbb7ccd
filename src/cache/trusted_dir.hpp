// A directory the cache may load executable code from: opened once, checked on the opened
// descriptor (owner, no group or other write bit), and used only through that descriptor
// (openat, renameat, unlinkat), so that a path swapped for a link after the check is never
// followed. Files are opened with O_NOFOLLOW | O_NONBLOCK and read only when they are regular
// files within a size bound: a link, a directory, a FIFO or a device never blocks or floods a
// reader.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace csa::cache {

enum class Owner {
  kCurrentUser,        // the directory csa writes to
  kCurrentUserOrRoot,  // a read-only layer (an image or a node may ship root-owned cubins)
};

class TrustedDir {
 public:
  // The directory at `path`, or nullptr with `why` (absent: *absent is set). `create`: make it
  // (and missing parents) with mode 0700 first.
  static std::unique_ptr<TrustedDir> open(const std::string& path, Owner owner, bool create,
                                          std::string* why, bool* absent = nullptr);
  ~TrustedDir();
  TrustedDir(const TrustedDir&) = delete;
  TrustedDir& operator=(const TrustedDir&) = delete;

  const std::string& path() const { return path_; }
  // False on a read-only mount or without write permission: loads only.
  bool writable() const { return writable_; }

  enum class Read { kOk, kMissing, kRejected };
  // Reads `name` whole into `bytes`. kRejected (with `why`): not a regular file, larger than
  // `max_bytes`, or unreadable. `touch`: mark it used (its mtime is the eviction clock).
  Read read(const std::string& name, std::size_t max_bytes, bool touch, std::vector<char>& bytes,
            std::string* why) const;
  // The first `n` bytes of a regular file `name` equal `prefix`.
  bool starts_with(const std::string& name, const char* prefix, std::size_t n) const;

  // Publishes `bytes` as `name`: a fresh temp file (`temp_name`), fsync, rename over `name`,
  // fsync of the directory. A temp file that vanishes before its rename (another process
  // cleaning up) is written again, up to three times. False with `why` on failure.
  bool publish(const std::string& name, const std::vector<char>& bytes,
               std::string (*temp_name)(const std::string&), std::string* why) const;
  // Removes `name` (an empty directory too); false if it could not.
  bool remove(const std::string& name) const;

  struct File {
    std::string name;
    bool regular = false;
    std::int64_t bytes = 0;
    std::int64_t mtime_ns = 0;
  };
  std::vector<File> list() const;  // never follows links

 private:
  TrustedDir(int fd, std::string path, bool writable)
      : fd_(fd), path_(std::move(path)), writable_(writable) {}
  int fd_;
  std::string path_;
  bool writable_;
};

}  // namespace csa::cache
