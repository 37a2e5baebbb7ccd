#include "cache/trusted_dir.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

namespace csa::cache {

namespace {

std::string error_text(int error) {
  return std::strerror(error);
}

// mkdir -p with mode 0700 for every directory it creates.
bool make_private_dirs(const std::string& dir, std::string* why) {
  std::filesystem::path partial;
  for (const auto& part : std::filesystem::path(dir)) {
    partial /= part;
    if (partial.empty() || partial == partial.root_path()) continue;
    if (::mkdir(partial.c_str(), 0700) != 0 && errno != EEXIST) {
      *why = fmt::format("cannot create {}: {}", partial.string(), error_text(errno));
      return false;
    }
  }
  return true;
}

// The checks of the opened directory; empty when trusted.
std::string distrust(int fd, Owner owner) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return fmt::format("fstat failed: {}", error_text(errno));
  if (!S_ISDIR(st.st_mode)) return "not a directory";
  const uid_t me = ::geteuid();
  // NOTE: csa loads executable code from here; a directory someone else owns or may write
  // to could hand it theirs.
  if (st.st_uid != me && !(owner == Owner::kCurrentUserOrRoot && st.st_uid == 0)) {
    return fmt::format("owned by uid {}, not by the current user (uid {}){}", st.st_uid, me,
                       owner == Owner::kCurrentUserOrRoot ? " or root" : "");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) return "writable by group or others";
  return {};
}

bool is_writable(int fd) {
  struct statvfs vfs {};
  if (::fstatvfs(fd, &vfs) == 0 && (vfs.f_flag & ST_RDONLY) != 0) return false;
  return ::faccessat(fd, ".", W_OK | X_OK, AT_EACCESS) == 0;
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

bool write_all(int fd, const std::vector<char>& bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  return ::fsync(fd) == 0;
}

}  // namespace

std::unique_ptr<TrustedDir> TrustedDir::open(const std::string& path, Owner owner, bool create,
                                             std::string* why, bool* absent) {
  if (absent != nullptr) *absent = false;
  if (create && !make_private_dirs(path, why)) return nullptr;
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT && absent != nullptr) *absent = true;
    *why = fmt::format("{}: {}", path, error_text(error));
    return nullptr;
  }
  const std::string reason = distrust(fd, owner);
  if (!reason.empty()) {
    ::close(fd);
    *why = fmt::format("{} is {}", path, reason);
    return nullptr;
  }
  return std::unique_ptr<TrustedDir>(new TrustedDir(fd, path, is_writable(fd)));
}

TrustedDir::~TrustedDir() {
  ::close(fd_);
}

TrustedDir::Read TrustedDir::read(const std::string& name, std::size_t max_bytes, bool touch,
                                  std::vector<char>& bytes, std::string* why) const {
  const Fd fd(::openat(fd_, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) return Read::kMissing;
    *why = errno == ELOOP ? "a symbolic link" : fmt::format("cannot open: {}", error_text(errno));
    return Read::kRejected;
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    *why = fmt::format("fstat failed: {}", error_text(errno));
    return Read::kRejected;
  }
  if (!S_ISREG(st.st_mode)) {
    *why = S_ISDIR(st.st_mode) ? "a directory" : "not a regular file";
    return Read::kRejected;
  }
  if (st.st_size < 0 || static_cast<std::uint64_t>(st.st_size) > max_bytes) {
    *why = fmt::format("{} bytes, more than an entry may hold ({})", st.st_size, max_bytes);
    return Read::kRejected;
  }
  bytes.resize(static_cast<std::size_t>(st.st_size));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<std::size_t>(n);
  }
  bytes.resize(done);  // a file shrinking under us reads short: the decoder rejects it
  if (touch && writable_) ::futimens(fd.get(), nullptr);  // best effort: the eviction clock
  return Read::kOk;
}

bool TrustedDir::starts_with(const std::string& name, const char* prefix, std::size_t n) const {
  const Fd fd(::openat(fd_, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  struct stat st {};
  if (fd.get() < 0 || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  std::vector<char> head(n);
  return ::pread(fd.get(), head.data(), n, 0) == static_cast<ssize_t>(n) &&
         std::memcmp(head.data(), prefix, n) == 0;
}

bool TrustedDir::publish(const std::string& name, const std::vector<char>& bytes,
                         std::string (*temp_name)(const std::string&), std::string* why) const {
  constexpr int kAttempts = 3;
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const std::string tmp = temp_name(name);
    {
      const Fd fd(
          ::openat(fd_, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
      if (fd.get() < 0) {
        *why = fmt::format("cannot create {}/{}: {}", path_, tmp, error_text(errno));
        return false;
      }
      if (!write_all(fd.get(), bytes)) {
        *why = fmt::format("cannot write {}/{}: {}", path_, tmp, error_text(errno));
        ::unlinkat(fd_, tmp.c_str(), 0);
        return false;
      }
    }
    // NOTE: rename() within one directory is atomic on POSIX file systems: a reader sees the
    // old file, the new one, or none, never a partial one. Racing writers each publish a
    // complete entry (identical bytes: compiles are reproducible); the last rename wins.
    if (::renameat(fd_, tmp.c_str(), fd_, name.c_str()) == 0) {
      ::fsync(fd_);
      return true;
    }
    const int error = errno;
    ::unlinkat(fd_, tmp.c_str(), 0);
    *why = fmt::format("cannot rename {}/{} to {}: {}", path_, tmp, name, error_text(error));
    if (error != ENOENT) return false;  // ENOENT: the temp file vanished; write it again
  }
  return false;
}

bool TrustedDir::remove(const std::string& name) const {
  if (::unlinkat(fd_, name.c_str(), 0) == 0) return true;
  return errno == EISDIR && ::unlinkat(fd_, name.c_str(), AT_REMOVEDIR) == 0;
}

std::vector<TrustedDir::File> TrustedDir::list() const {
  std::vector<File> out;
  // A descriptor of its own (not a dup, which would share the read position with others).
  const int fd = ::openat(fd_, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return out;
  DIR* dir = ::fdopendir(fd);
  if (dir == nullptr) {
    ::close(fd);
    return out;
  }
  while (const dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    if (::fstatat(fd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
    File f;
    f.name = name;
    f.regular = S_ISREG(st.st_mode);
    f.bytes = st.st_size;
    f.mtime_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
    out.push_back(std::move(f));
  }
  ::closedir(dir);
  return out;
}

}  // namespace csa::cache
